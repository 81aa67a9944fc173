"""The embedded corpus's token kinds read off a token stream by its grammar's surface: the independent reference the
loss breakdown's tests check the generator's own labels against."""

from adaptive_ds.data.embedded import COMPUTED, COPIED, NAME, NAME_LENGTH, RELATIONS, fact_table


def expected_kinds(tokens: list[str]) -> list[str]:
    """The kinds read off the token stream by the grammar's surface, without the generator's bookkeeping: a name is
    NAME_LENGTH syllables before a relation ([facts]) or after the [bio] tag; a fact value follows its relation and
    is the table's; an answer's digits run from '=' to ';'; a recall value follows 'get' and its key."""
    table = fact_table()
    index = {name: i for i, name in enumerate(table.names)}
    kinds = [""] * len(tokens)
    tag, entity, i = tokens[0], None, 1
    if tag == "[bio]":
        entity = index[tuple(tokens[1:1 + NAME_LENGTH])]
        kinds[1:1 + NAME_LENGTH] = [NAME] * NAME_LENGTH
        i = 1 + NAME_LENGTH
    while i < len(tokens):
        t = tokens[i]
        if tag == "[facts]" and tuple(tokens[i:i + NAME_LENGTH]) in index:
            entity = index[tuple(tokens[i:i + NAME_LENGTH])]
            kinds[i:i + NAME_LENGTH] = [NAME] * NAME_LENGTH
            i += NAME_LENGTH
            continue
        if t in RELATIONS and tag in ("[facts]", "[bio]"):
            value = table.facts[entity][t]
            assert tuple(tokens[i + 1:i + 1 + len(value)]) == value  # the table's value, read back
            kinds[i + 1:i + 1 + len(value)] = [f"fact:{entity}"] * len(value)
            i += 1 + len(value)
            continue
        if t == "=":
            j = i + 1
            while tokens[j] != ";":
                kinds[j] = COMPUTED
                j += 1
            i = j
            continue
        if t == "get":  # get KEY VALUE
            kinds[i + 2] = COPIED
            i += 3
            continue
        i += 1
    return kinds

