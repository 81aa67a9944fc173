"""Configuration of the adaptive_ds decoder: one class for all four architectures."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from transformers import PreTrainedConfig

from .architectures import ARCH_SPECS, ArchitectureSpec, architecture_spec
from .defaults import ARCHITECTURE_DEFAULTS, CONFIG_VERSION, REMOVED_FIELDS, UNVERSIONED_DEFAULTS

# (The registered architectures are read from ARCH_SPECS where they are asked, so that one registered later counts.)
MOD_CAUSAL_ROUTINGS = ("router", "predictor")
POSITIVE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "num_local_experts", "num_experts_per_tok",
                  "moe_ep_size", "moe_layer_interval", "moe_expert_granularity", "mod_layer_interval",
                  "mod_predictor_hidden_size")
MOE_BALANCING = ("aux_loss", "bias")
# RoPE scalings (`rope_scaling_parameters["rope_type"]`, as transformers names them) and the keys each needs
ROPE_SCALING_KEYS = {"linear": ("factor",), "dynamic": ("factor",),
                     "yarn": ("factor", "original_max_position_embeddings"),
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


@dataclass(repr=False)
class AdaptiveDSConfig(PreTrainedConfig):
    """A Llama-style decoder whose MLPs may be Mixture-of-Experts layers and whose blocks may be MoD-routed.

    `arch` selects the family:
      - ``dense``: every block is attention + SwiGLU MLP;
      - ``moe``: every ``moe_layer_interval``-th MLP is a routed mixture of SwiGLU experts (``models/moe.py``; in
        adaptive_ds's trainer, inside a ``deepspeed.moe.layer.MoE``);
      - ``mod``: every ``mod_layer_interval``-th block is wrapped by a Mixture-of-Depths router;
      - ``hybrid``: both, so MoD decides which tokens ever reach the experts.

    An MoE layer has ``num_local_experts x moe_expert_granularity`` routed experts of width
    ``intermediate_size / moe_expert_granularity``, each token routed to ``num_experts_per_tok x
    moe_expert_granularity`` of them, plus ``moe_shared_experts`` always-on experts of the same width (DeepSeekMoE,
    Dai et al. 2024, arXiv 2401.06066): granularity 1 and no shared experts is the GShard / Mixtral layer.

    A field left unset (None) takes its architecture's default (``models/defaults.py``, the plain variants of
    ``adaptive_ds.presets.VARIANTS``): ``AdaptiveDSConfig(arch="mod")`` is the model ``--arch mod`` trains (12.5%
    capacity in every other block). ``config_version`` keeps a saved config meaning what it meant: a config dict
    without it (a config.json, final/ folder or checkpoint identity written before it; ``from_dict``) reads its unset
    fields as the field defaults of then (``mod_capacity`` 0.5 in every block, top-2 with capacity), and a config
    built or read now holds every field, so it saves as the current version.
    """

    model_type = "adaptive_ds"
    keys_to_ignore_at_inference = ["cache"]

    arch: str = "dense"
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    # The features of the model families a run starts from (models/families/), each off by default; off, a feature
    # adds no parameter and draws no random number.
    tie_word_embeddings: bool = False  # the LM head is the input embedding (Llama 3.2, SmolLM2, Qwen2.5, Qwen3)
    head_dim: int | None = None  # None: hidden_size / num_attention_heads (Qwen3's differs)
    attention_qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2; Llama's attention_bias)
    attention_out_bias: bool = False  # a bias on the output projection (Llama's attention_bias)
    qk_norm: bool = False  # RMSNorm over each head's queries and keys, before RoPE (Qwen3)
    # RoPE scaling as transformers' rope_parameters hold it, less rope_theta: {"rope_type": "llama3", "factor": 32.0,
    # ...}; rope_type one of ROPE_SCALING_KEYS (models/rope.py). None: plain RoPE.
    rope_scaling_parameters: dict | None = None
    # Mistral's and Qwen's sliding-window attention: kept so the model exports as it came, and accepted only where
    # no sequence is longer than the window (the attention is full causal attention, which is then the same).
    sliding_window: int | None = None
    # The model_type of the stock family whose weights the model started from (--init_from; models/families/),
    # kept through upcycling and our own folders: what `python -m adaptive_ds.export --to auto` converts to.
    source_model_type: str | None = None
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Mixture of Experts (arch moe / hybrid). moe_ep_size: the processes one layer's experts are split over; a
    # model built with it holds num_routed_experts / moe_ep_size of them (saved final/ folders have 1: all).
    num_local_experts: int = 8
    num_experts_per_tok: int | None = None  # None: the architecture's default (models/defaults.py)
    moe_layer_interval: int = 1
    moe_intermediate_size: int | None = None  # a routed expert's width before granularity; None: intermediate_size
    # k >= 2: the top-k gate weights renormalised over the k (Mixtral); False: the softmax probabilities as they are
    # (Qwen3-MoE's norm_topk_prob false). Top-1 follows moe_renormalize_top1.
    moe_norm_topk_prob: bool = True
    moe_capacity_factor: float = 1.25  # training only: inference is dropless (see moe.py)
    moe_min_capacity: int = 4
    # Training-time routing: True caps each expert at moe_capacity_factor of an even share (GShard; overflow is
    # dropped), False is dropless (every token reaches its top-k experts). Inference is always dropless.
    # None: the architecture's default.
    moe_drop_tokens: bool | None = None
    moe_ep_size: int = 1
    # "indexed" (sorted tokens, grouped GEMM) or "deepspeed" (DeepSpeed's stock layer, the baseline: trains only
    # where adaptive_ds's trainer swapped that layer in; inference is indexed either way)
    moe_dispatch: str = "indexed"
    moe_grouped_gemm: str = "auto"  # torch._grouped_mm: "auto" (Hopper bf16), "always" or "never"
    moe_jitter: bool = False  # multiplicative jitter on the router input in training (Switch Transformer)
    moe_use_residual: bool = False  # PR-MoE residual: a dense MLP mixed with the experts
    moe_expert_granularity: int = 1  # g: split each expert into g experts of width ffn / g, route top-k x g
    moe_shared_experts: int = 0  # always-on experts of width ffn / g, one dense SwiGLU added to the routed output
    # "aux_loss": the load-balancing loss, weighted by router_aux_loss_coef. "bias": auxiliary-loss-free balancing
    # (DeepSeek-V3, arXiv 2412.19437 sec. 2.1.2): a per-expert bias on the routing scores, used for the top-k
    # choice only, moved by moe_bias_update_rate after each optimizer step toward an even load; the aux loss is
    # then reported but not added to the loss.
    moe_balancing: str = "aux_loss"
    moe_bias_update_rate: float = 1e-3  # gamma: the bias step per optimizer step (with moe_balancing "bias")
    # Top-1 only (k >= 2 is always renormalised over its choices): False weighs a token's expert output by its raw
    # gate probability (Switch Transformer); True renormalises it over its one choice, as Mixtral's rule gives for
    # k = 1: the weight is exactly 1 in the forward pass, with the probability's gradient (straight-through, Bengio
    # et al. 2013, arXiv 1308.3432), so the LM loss still trains the router. A dense model upcycled to top-1 (the
    # hybrid's default) turns it on: identical experts then give the dense output.
    moe_renormalize_top1: bool = False
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.001
    # Mixture of Depths (arch mod / hybrid). None: the architecture's default.
    mod_capacity: float | None = None
    mod_layer_interval: int | None = None  # 1: every block, 2: every other
    # How inference routes causally (mod.py): "router" (the router's own logit > 0, trained toward top-k
    # membership by a BCE loss on those logits) or "predictor" (a separate MLP on the detached block input).
    # Causal-routing against top-k-routing validation loss for both: BENCHMARKS.md, section grid:debug:embedded-hard
    # (mod and mod:predictor).
    mod_causal_routing: str = "router"
    mod_predictor_hidden_size: int = 64  # the predictor's MLP width (mod_causal_routing "predictor")
    mod_predictor_loss_coef: float = 1.0  # weight of the causal-routing BCE loss (router's or predictor's)
    # How a routed token's block update is scaled (mod.py): False by sigmoid(router logit), as the architecture
    # ships; True by a straight-through scale, exactly 1 in the forward pass with sigmoid's gradient (Bengio et al.
    # 2013, arXiv 1308.3432), so that a block every token runs is the plain block. A dense model retrofitted with
    # MoD (--init_from DENSE --arch mod / hybrid) turns it on: at capacity 1.0, or with set_mod_routing("all"), the
    # model then computes the dense function.
    mod_straight_through: bool = False
    # How the unset fields of a saved config read (see the class doc); a config built now is of the current version.
    config_version: int = CONFIG_VERSION

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        if "config_version" not in config_dict:  # written before config_version: its unset fields read as then
            config_dict = {**config_dict, "config_version": 1}
            # A saved MoD or hybrid config without `mod_causal_routing` predates it: its model was trained with the
            # predictor. (For the other architectures the field does nothing, and its default stands.)
            if "mod_causal_routing" not in config_dict and config_dict.get("arch") in ("mod", "hybrid"):
                config_dict["mod_causal_routing"] = "predictor"
        return super().from_dict(config_dict, **kwargs)

    def __post_init__(self, **kwargs):
        if self.config_version > CONFIG_VERSION:  # its unset fields mean what a newer adaptive_ds says
            raise ValueError(f"config_version {self.config_version} is newer than this adaptive_ds reads "
                             f"({CONFIG_VERSION}); upgrade adaptive_ds to load it")
        if self.head_dim is None and self.num_attention_heads >= 1:
            self.head_dim = self.hidden_size // self.num_attention_heads
        defaults = dict(UNVERSIONED_DEFAULTS)
        if self.config_version >= 2:
            defaults.update(ARCHITECTURE_DEFAULTS.get(self.arch, {}))
        for name, value in defaults.items():
            if getattr(self, name) is None:  # unset
                setattr(self, name, value)
        self.config_version = CONFIG_VERSION  # every field is set now: it saves as what it is
        for name in REMOVED_FIELDS:  # what older configs carry: nothing reads it
            kwargs.pop(name, None)
        super().__post_init__(**kwargs)
        problems = self.problems()
        if problems:
            raise ValueError("invalid AdaptiveDSConfig: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every inconsistency in the configuration, so callers can report them all at once."""
        found = [f"{name} must be >= 1, got {getattr(self, name)}" for name in POSITIVE_SIZES
                 if getattr(self, name) < 1]
        if found:
            return found  # the checks below divide by these
        if self.arch not in ARCH_SPECS:
            found.append(f"arch {self.arch!r} is not one of {', '.join(ARCH_SPECS)}")
        # (heads of another width than hidden / heads need an explicit head_dim)
        quotient = self.hidden_size // self.num_attention_heads
        if self.hidden_size % self.num_attention_heads and self.head_dim == quotient:
            found.append(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                         f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            found.append(f"num_attention_heads {self.num_attention_heads} is not divisible by "
                         f"num_key_value_heads {self.num_key_value_heads}")
        found += self._feature_problems()
        if self.uses_moe:
            found += self._moe_problems()
        if self.uses_mod:
            if not 0.0 < self.mod_capacity <= 1.0:
                found.append(f"mod_capacity must be in (0, 1], got {self.mod_capacity}")
            if self.mod_layer_interval not in (1, 2):
                found.append(f"mod_layer_interval must be 1 (every block) or 2 (every other), "
                             f"got {self.mod_layer_interval}")
            if self.mod_causal_routing not in MOD_CAUSAL_ROUTINGS:
                found.append(f"mod_causal_routing must be one of {', '.join(MOD_CAUSAL_ROUTINGS)}, "
                             f"got {self.mod_causal_routing!r}")
        return found

    def _feature_problems(self) -> list[str]:
        found = []
        if self.head_dim < 2 or self.head_dim % 2:
            found.append(f"head_dim must be an even number >= 2 (RoPE rotates pairs), got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            found.append(f"sliding_window must be >= 1 or null, got {self.sliding_window}")
        scaling = self.rope_scaling_parameters
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
            if kind not in ROPE_SCALING_KEYS:
                found.append(f"rope_scaling_parameters rope_type {kind!r} is not one of {', '.join(ROPE_SCALING_KEYS)} "
                             "(null: plain RoPE)")
            else:
                missing = [key for key in ROPE_SCALING_KEYS[kind] if scaling.get(key) is None]
                if missing:
                    found.append(f"rope_scaling_parameters of rope_type {kind!r} needs {', '.join(missing)}")
        return found

    def _moe_problems(self) -> list[str]:
        found = []
        if self.num_experts_per_tok > self.num_local_experts:
            found.append(f"num_experts_per_tok {self.num_experts_per_tok} exceeds num_local_experts "
                         f"{self.num_local_experts}")
        if self.num_routed_experts % self.moe_ep_size:
            found.append(f"the {self.num_routed_experts} routed experts (num_local_experts x moe_expert_granularity) "
                         f"are not divisible by moe_ep_size {self.moe_ep_size}")
        expert_width = self.moe_intermediate_size or self.intermediate_size
        if expert_width % self.moe_expert_granularity:
            found.append(f"the expert width {expert_width} (moe_intermediate_size, else intermediate_size) is not "
                         f"divisible by moe_expert_granularity {self.moe_expert_granularity}")
        if self.moe_shared_experts < 0:
            found.append(f"moe_shared_experts must be >= 0, got {self.moe_shared_experts}")
        if self.moe_dispatch not in ("indexed", "deepspeed"):
            found.append(f"moe_dispatch must be 'indexed' or 'deepspeed', got {self.moe_dispatch!r}")
        elif self.moe_dispatch == "deepspeed" and self.num_routed_experts_per_tok > 2:
            # DeepSpeed's top-k > 2 gating drops overflow by gate probability, not by the GShard priorities the
            # indexed path keeps for every k, so the two modes would train differently.
            found.append(f"moe_dispatch 'deepspeed' routes top-1 or top-2 (DeepSpeed's gating); top-"
                         f"{self.num_routed_experts_per_tok} (num_experts_per_tok x moe_expert_granularity) needs "
                         "moe_dispatch 'indexed'")
        if self.moe_grouped_gemm not in ("auto", "always", "never"):
            found.append(f"moe_grouped_gemm must be 'auto', 'always' or 'never', got {self.moe_grouped_gemm!r}")
        if self.moe_balancing not in MOE_BALANCING:
            found.append(f"moe_balancing must be one of {', '.join(MOE_BALANCING)}, got {self.moe_balancing!r}")
        elif self.moe_balancing == "bias" and self.moe_dispatch == "deepspeed":
            found.append("moe_balancing 'bias' needs moe_dispatch 'indexed' (DeepSpeed's gate has no routing bias)")
        if self.moe_bias_update_rate < 0:
            found.append(f"moe_bias_update_rate must be >= 0, got {self.moe_bias_update_rate}")
        if not self.moe_norm_topk_prob and self.moe_dispatch == "deepspeed":
            found.append("moe_norm_topk_prob false needs moe_dispatch 'indexed' (DeepSpeed's top-2 gate renormalises)")
        if self.moe_renormalize_top1 and self.moe_dispatch == "deepspeed":
            found.append("moe_renormalize_top1 needs moe_dispatch 'indexed' (DeepSpeed's top-1 gate weighs by the "
                         "gate probability)")
        if self.moe_drop_tokens and self.moe_capacity_factor <= 0:
            found.append(f"moe_capacity_factor must be > 0 with moe_drop_tokens (or set moe_drop_tokens false for "
                         f"dropless routing), got {self.moe_capacity_factor}")
        return found

    @property
    def num_routed_experts(self) -> int:
        """Experts a token can be routed to in an MoE layer: num_local_experts split moe_expert_granularity ways."""
        return self.num_local_experts * self.moe_expert_granularity

    @property
    def num_routed_experts_per_tok(self) -> int:
        return self.num_experts_per_tok * self.moe_expert_granularity

    @property
    def expert_intermediate_size(self) -> int:
        """The width of one routed (and one shared) expert."""
        return (self.moe_intermediate_size or self.intermediate_size) // self.moe_expert_granularity

    @property
    def shared_intermediate_size(self) -> int:
        """The width of the shared experts together (0: none)."""
        return self.moe_shared_experts * self.expert_intermediate_size

    @property
    def arch_spec(self) -> ArchitectureSpec:
        """What the trainer and the tools ask of this architecture (spec.py); ValueError in one line for an unknown
        arch."""
        return architecture_spec(self.arch)

    @property
    def uses_moe(self) -> bool:
        spec = ARCH_SPECS.get(self.arch)  # None: an unknown arch, which problems() reports
        return spec is not None and spec.moe

    @property
    def uses_mod(self) -> bool:
        spec = ARCH_SPECS.get(self.arch)
        return spec is not None and spec.mod

    @property
    def num_moe_layers(self) -> int:
        """How many of its layers hold experts (0: none): what the expert options (their number, their split, expert
        parallelism) apply to."""
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def expert_parallel_size(self) -> int:
        """The processes one MoE layer's experts are split over: `moe_ep_size`, or 1 without experts."""
        return self.moe_ep_size if self.uses_moe else 1

    @property
    def zero3_problem(self) -> str | None:
        """Why this model does not train under DeepSpeed's ZeRO stage 3, one clause; None where it does."""
        return self.arch_spec.zero3_problem

    def unrouted(self) -> AdaptiveDSConfig:
        """This configuration with every block run on every token (MoD off, its experts kept): the baseline of a
        routed model's FLOPs reduction."""
        unrouted = copy.copy(self)
        unrouted.arch = self.arch_spec.unrouted or self.arch
        return unrouted

    def is_moe_layer(self, layer_idx: int) -> bool:
        """MoE MLPs sit in the last layer of every group of `moe_layer_interval` layers."""
        return self.uses_moe and (layer_idx + 1) % self.moe_layer_interval == 0

    def is_mod_layer(self, layer_idx: int) -> bool:
        """With interval 2 the odd blocks route, so the first block always sees every token (Raposo et al.)."""
        return self.uses_mod and (layer_idx + 1) % self.mod_layer_interval == 0
