"""A run that spans machines stops before it joins when gloo would listen on loopback (this host's name resolves to
a loopback address, or to none of this host's, and GLOO_SOCKET_IFNAME is unset): the other machines could never
connect. Judged with this machine's real resolver and sockets; the hosts' names are chosen so that the answer is
known: `localhost`, a name that cannot resolve, and this machine's own non-loopback addresses."""

import ipaddress

import psutil
import pytest

from adaptive_ds.distributed import gloo_address_problem

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.77.0.1"}  # 2 machines
DEEPSPEED = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_SIZE": "1", "CROSS_SIZE": "2", "MASTER_ADDR": "10.77.0.1"}


def _own_addresses() -> list[str]:
    """This machine's addresses that other machines could reach (not loopback, not link-local)."""
    found = [a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
             if a.family.name in ("AF_INET", "AF_INET6")]
    return [a for a in found if not (ipaddress.ip_address(a).is_loopback or ipaddress.ip_address(a).is_link_local)]


@pytest.mark.parametrize("environ", [TORCHRUN, DEEPSPEED])
def test_a_loopback_host_name_across_machines_is_named_with_its_fix(environ):
    problem = gloo_address_problem(environ, hostname="localhost")
    assert problem.startswith("the run spans 2 machines, but gloo would listen on loopback (this host's "
                              "name 'localhost' resolves to "), problem
    assert "set GLOO_SOCKET_IFNAME" in problem


def test_a_host_name_that_does_not_resolve_falls_back_to_loopback():
    problem = gloo_address_problem(TORCHRUN, hostname="no-such-host.invalid")
    assert "'no-such-host.invalid' resolves to no address of this host, so gloo falls back to 127.0.0.1" in problem


@pytest.mark.parametrize("environ", [
    {**TORCHRUN, "GLOO_SOCKET_IFNAME": "eth0"},  # the user chose the interface
    {**TORCHRUN, "MASTER_ADDR": "127.0.0.1"},  # every "machine" is this one (the loopback two-node example)
    {**TORCHRUN, "MASTER_ADDR": "localhost"},
    {**TORCHRUN, "LOCAL_WORLD_SIZE": "4"},  # one machine
    {**DEEPSPEED, "LOCAL_SIZE": "2"},
    {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.77.0.1"},  # no launcher's local count: not judged
    {},  # a plain start
])
def test_nothing_is_said_where_loopback_reaches_every_process_or_the_user_chose(environ):
    assert gloo_address_problem(environ, hostname="localhost") is None


def test_a_host_name_that_resolves_to_an_address_of_this_host_is_fine():
    own = _own_addresses()
    if not own:
        pytest.skip("this machine has no address but loopback")
    assert gloo_address_problem(TORCHRUN, hostname=own[0]) is None
