"""Rotary position embeddings (RoPE, Su et al. 2021, arXiv 2104.09864) and the scalings the model families use to
stretch a model's context, with the parameters transformers' `rope_parameters` hold (less `rope_theta`):

- ``linear`` (position interpolation, Chen et al. 2023, arXiv 2306.15595): every frequency divided by `factor`;
- ``dynamic`` (dynamic NTK scaling): past `max_position_embeddings` tokens, the base grows with the length
  seen, base * (factor * L / max - (factor - 1)) ^ (d / (d - 2)), so the frequencies depend on the forward's
  length; within the original context it is plain RoPE;
- ``yarn`` (Peng et al. 2023, arXiv 2309.00071, sec. 3.2-3.4): frequencies ramp from interpolated (wavelengths
  longer than the context) to extrapolated (short ones) between the dimensions that rotate `beta_slow` and
  `beta_fast` times over `original_max_position_embeddings`, and cos and sin are scaled by the attention factor
  0.1 ln(factor) + 1 (or `attention_factor`, or DeepSeek's ratio of two such factors through `mscale` and
  `mscale_all_dim`);
- ``llama3`` (Llama 3.1): wavelengths longer than original / `low_freq_factor` divided by `factor`, shorter than
  original / `high_freq_factor` kept, a smooth mix between.

Each returns the (head_dim / 2,) float32 inverse frequencies and the factor on cos and sin. Plain Python and torch:
final/ folders carry this file with the model code.
"""

from __future__ import annotations

import math

import torch


def plain_frequencies(head_dim: int, theta, device=None) -> torch.Tensor:
    """theta ^ (-2i / d) for i < d / 2: (d / 2,) float32 (`theta` a float, or a 0-d tensor for dynamic scaling)."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)


def _llama3(head_dim: int, theta: float, scaling: dict, device) -> torch.Tensor:
    inv_freq = plain_frequencies(head_dim, theta, device)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    long = wavelength > context / low  # low frequencies: interpolated
    scaled = torch.where(long, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)  # 0 at the long end of the band, 1 at the short end
    between = ~long & ~(wavelength < context / high)
    return torch.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def _yarn_attention_factor(scaling: dict, factor: float) -> float:
    def mscale(scale: float, m: float = 1.0) -> float:  # YaRN eq. 22's sqrt(1/t), 0.1 ln(s) + 1
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


def _yarn(head_dim: int, theta: float, scaling: dict, device) -> tuple[torch.Tensor, float]:
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension(rotations: float) -> float:  # the dimension that rotates `rotations` times over the context
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of width 0 would divide by 0
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolated = plain_frequencies(head_dim, theta, device)
    # ramp 0 (short wavelengths): extrapolated, unchanged; ramp 1 (long ones): interpolated, divided by factor
    inv_freq = extrapolated / factor * ramp + extrapolated * (1 - ramp)
    return inv_freq, _yarn_attention_factor(scaling, factor)


def _dynamic(head_dim: int, theta: float, scaling: dict, context: int, length: torch.Tensor) -> torch.Tensor:
    """`length`: the forward's longest position + 1, a 0-d tensor (read on the device: no host sync)."""
    factor = scaling["factor"]
    length = length.float().clamp_min(context)
    base = theta * (factor * length / context - (factor - 1)) ** (head_dim / (head_dim - 2))
    return plain_frequencies(head_dim, base, length.device)


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None, max_position_embeddings: int,
                        position_ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The (head_dim / 2,) float32 inverse frequencies of a forward over `position_ids` and the factor on its cos
    and sin (1.0 but for yarn)."""
    device = position_ids.device
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind is None or kind == "default":
        return plain_frequencies(head_dim, theta, device), 1.0
    if kind == "linear":
        return plain_frequencies(head_dim, theta, device) / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(head_dim, theta, scaling, device), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, device)
    if kind == "dynamic":
        return _dynamic(head_dim, theta, scaling, max_position_embeddings, position_ids.max() + 1), 1.0
    raise ValueError(f"unknown RoPE scaling {kind!r}")  # the configuration refuses it first


def rotary_embedding(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                     scaling: dict | None = None, max_position_embeddings: int | None = None):
    """cos and sin of RoPE for `position_ids` (batch, seq): each (batch, seq, head_dim). `scaling`: the
    configuration's `rope_scaling_parameters` (None: plain RoPE); dynamic scaling reads `max_position_embeddings`."""
    inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling, max_position_embeddings,
                                                     position_ids)
    angles = position_ids.float().unsqueeze(-1) * inv_freq  # (batch, seq, head_dim / 2)
    angles = torch.cat((angles, angles), dim=-1)
    if attention_factor == 1.0:
        return angles.cos().to(dtype), angles.sin().to(dtype)
    return (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)


@torch.compiler.assume_constant_result
def rotary_table(length: int, head_dim: int, theta: float, dtype: torch.dtype, device: torch.device,
                 scaling: dict | None = None, max_position_embeddings: int | None = None) -> torch.Tensor:
    """(2, 1, length, head_dim): `rotary_embedding`'s cos and sin of positions 0 .. length - 1. Marked a constant
    result: torch.compile calls it when it traces a forward and keeps the table as a constant of the graph (its
    arguments are Python values the graph is guarded on already: the input's device and dtype, configuration
    fields)."""
    positions = torch.arange(length, device=device)[None]
    return torch.stack(rotary_embedding(positions, head_dim, theta, dtype, scaling, max_position_embeddings))
