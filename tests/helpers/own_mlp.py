"""An MLP of an architecture's own for the unit tests of the architecture registry: no gate_proj, so a Llama's
SwiGLU weights cannot start it, and 2 x hidden x intermediate weights (`own_mlp_parameters`)."""

from torch import nn


class GELUMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        return self.down_proj(nn.functional.gelu(self.up_proj(hidden_states)))


def own_mlp_parameters(config) -> int:
    return 2 * config.hidden_size * config.intermediate_size
