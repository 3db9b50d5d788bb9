"""Typed training configuration: dataclass defaults, YAML files that may name a base, overrides.

A config file is YAML with the run-wide keys at the top level and the others in sections by concern
(``model``, ``precision``, ``memory``, ``data``, ``optimizer``, ``checkpoint``, ``eval``,
``logging``, ``xla``, ``mesh``; :mod:`coat_jax.training.config_names` names each key, and refuses a
flat key, e.g. ``fp8_attention``, with its sectioned name). ``base: other.yaml`` (relative to the
file) is loaded first and then updated key by key. Command-line overrides are ``key=value`` or
``section.key=value``; values are parsed as YAML scalars (``steps=100``, ``init_from=null``,
``resume=true``). ``recipe: NAME`` (:mod:`coat_jax.recipes`) gives the keys that neither the files
nor the overrides set. Every value is checked against the field's type, and an unknown key is
rejected with its close matches.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from coat_jax import quant, recipes
from coat_jax.fp8.config import (
    ATTENTION_BACKWARDS,
    LINEAR_SCALINGS,
    PRECISIONS,
    SWIGLU_OPS,
    WEIGHT_RESIDUALS,
    FP8Config,
)
from coat_jax.llama import REMAT_POLICIES, LlamaConfig
from coat_jax.training.config_names import field_of, flatten, name_of, nest
from coat_jax.training.config_values import coerce, read_config_file, set_dotted
from coat_jax.training.data import DEFAULT_DATA_PATH, DataSource, check_data_keys
from coat_jax.training.kernel_choice import (
    Kernels,
    check_kernels,
    kernels_mapping,
    names_fp8_ops,
    to_yaml,
)

# The ``model`` section is a :class:`coat_jax.llama.LlamaConfig` (one source of truth for the
# architecture, ``rope_scaling`` included). Keys a config leaves out take these values, the tiny
# model of ``python train.py``, not LlamaConfig's Llama-2-7B defaults.
DEFAULT_MODEL = {
    "vocab_size": 258,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": None,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
}
RematName = Literal[tuple(REMAT_POLICIES)]
_FP8_DEFAULTS = FP8Config()


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh ``(data, fsdp)``; one entry may be -1 for "all remaining devices"."""

    data: int = 1
    fsdp: int = -1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; configs/default.yaml spells out every default.

    Keys whose meaning is not obvious from the name:

    - ``recipe``: a name of ``coat_jax.recipes.RECIPES``, whose settings replace the defaults
      of the keys it names; a key set in a config file or on the command line wins.
      :func:`load_config` and :func:`from_dict` apply it (``from_dict({"recipe": "bf16"})``);
      a ``TrainConfig(...)`` built by hand takes the values it is given.
    - ``resume``: continue from the newest checkpoint in ``output_dir``. Without it a run
      refuses an ``output_dir`` that already holds another run's checkpoints or metrics
      (``overwrite: true`` deletes them and starts anew). A resume keeps the learning-rate
      schedule of the checkpoint's run even when ``steps`` changes, unless
      ``reschedule: true`` spreads it over the new ``steps``.
    - ``init_from``: a Hugging Face folder (any family of ``coat_jax.families``), a coat-jax
      folder or a Llama ``.gguf`` file
      (``pkg:PACKAGE/FILE`` finds a file inside an installed package). Its architecture
      replaces the ``model`` section, which only describes models trained from scratch.
    - ``data.tokenizer``: ``byte`` (UTF-8 bytes, vocabulary 258), ``init_from`` (the checkpoint's
      own) or a path that ``coat_jax.load_tokenizer`` reads.
    - ``precision.compute_dtype``: activation dtype; master weights are always float32.
    - ``memory.scan_layers``: stack the decoder layers and run them with ``jax.lax.scan`` (one
      compiled layer; MaxText's ``scan_layers``). Checkpoints of either layout resume in the other.
    - ``memory.remat``: rematerialization policy of the decoder layers, a name of
      ``coat_jax.llama.REMAT_POLICIES`` (``none``, ``full``, ``attention``, ``activations``).
    - ``precision.fp8_attention``: keep attention's q, k, v in FP8 for backward
      (``Llama(fp8_attention=)``; precision ``fp8`` or ``coat``).
    - ``precision.fp8_weight_residual``: how the FP8 linears get their weights' E4M3 codes
      (``FP8Config.weight_residual``). ``once`` (default): every linear weight is quantized
      once per step before the layers run, all layers of a scanned model in one pass, and
      forward and backward read those codes (1 byte per weight for the whole step; faster than
      ``master`` for a little more memory: docs/memory_options.md). ``master``
      quantizes in forward and again in backward, keeping no codes (the leanest, e.g. with
      ``optimizer_in_backward``); ``fp8`` keeps forward's codes for backward
      (docs/memory_options.md).
    - ``precision.fp8_group_scale``: how the 1xG scales of the FP8 activations kept for backward are
      stored (``FP8Config.group_scale``): ``float32`` (COAT) or ``e8m0`` (power-of-two scales
      in one byte; precision ``coat``, or ``fp8`` with ``fp8_attention``; docs/memory_options.md).
    - ``precision.fp8_attention_backward``: what FP8 attention's backward runs from
      (``FP8Config.attention_backward``; needs ``fp8_attention``): ``recompute`` (default: the
      attention forward re-run from the FP8 q, k, v) or ``saved_output`` (attention and the
      o_proj as one op keeping the float32 softmax statistics and reading the output from the
      o_proj's FP8 input codes: no re-run; docs/memory_options.md, "FP8 attention").
    - ``precision.fp8_swiglu``: the MLP's SiLU and product in precision ``coat``
      (``FP8Config.swiglu``): ``coat`` (default, COAT: two FP8 ops keeping gate, the SiLU output and
      up) or ``fused`` (one op keeping gate and up, the SiLU recomputed in backward: one
      intermediate-size FP8 tensor less per layer; docs/memory_options.md, "Fused SwiGLU").
    - ``precision.fp8_linear_scaling``: how the FP8 linears scale their operands
      (``FP8Config.linear_scaling``; precision ``fp8`` or ``coat``, with
      ``fp8_weight_residual: master``): ``tensor`` (default, COAT: one scale per tensor),
      ``row`` (one per token and per output channel, FP8 backward GEMMs), ``row_gw_hp`` (the
      same, the weight gradient in BF16); ``coat_jax.fp8.rowwise``; or ``block`` (one per 1x128
      activation tile and 128x128 weight block, DeepSeek-V3's; ``coat_jax.fp8.blockwise``).
    - ``precision.master_dtype``: dtype of the trained parameters. ``bfloat16`` halves the master
      weights and their gradients; the optimizer still computes in float32 and each update is
      applied with stochastic rounding (``coat_jax.master``). An option, not a default: see
      docs/memory_options.md for its accuracy evidence.
    - ``kernels``: where coat_adamw's step and the FP8 ops' quantizers and fused non-linear ops
      run (:mod:`coat_jax.training.kernel_choice`): ``auto`` (the Pallas kernels on a GPU, per
      shard on a mesh, the FP8 ops by the run's shape; plain jnp elsewhere), ``xla`` (plain
      jnp) or ``pallas`` (the kernels, an error where one cannot run), or a mapping part by
      part, ``{optimizer: IMPL, fp8_ops: IMPL, OP: IMPL}`` with OP an op of
      ``coat_jax.fp8_ops.KERNEL_OPS``; a part left out takes ``auto``. ``fp8_ops`` unset
      follows the run's shape (``optimizers.fp8_ops_auto``): ``auto`` for a model at least
      4096 wide with at least 16384 microbatch tokens per device, else the ops run as XLA's
      fusions of their jnp references; the choice follows ``data.batch_size`` (``--plan``
      compiles its other batch sizes with it; docs/bench_fp8_kernels.md). Tests run the
      kernels in Pallas interpret mode on a CPU through the environment variable
      ``coat_jax.training.optimizers.PALLAS_INTERPRET_ENV``, not through this key.
    - ``optimizer.fused_apply``: coat_adamw's kernel also applies the update, reading each parameter
      and writing the new one in its own pass (``coat_jax.apply_gradients``); ``false``: optax's
      ``update`` then ``apply_updates``. Same state, same results to float32 rounding; kept with
      ``telemetry`` (which samples the old state before the kernel overwrites it), ignored with
      ``master_dtype: bfloat16`` and ``skip_nonfinite_steps``.
    - ``optimizer.in_backward``: update each decoder layer inside the backward pass, as soon as
      its gradient exists, so that the step never holds the whole gradient
      (``coat_jax.training.layerwise``; docs/memory_options.md). Needs ``scan_layers: true``
      and what works without the whole gradient first: ``grad_clip: null``,
      ``grad_accum: 1``, ``skip_nonfinite_steps: 0``, ``telemetry: false``. Its checkpoints
      hold the optimizer state per layer and resume only with it on.
    - ``memory.loss_chunk_size``: compute the cross-entropy in blocks of this many positions
      (``coat_jax.losses.cross_entropy_from_hidden``) instead of materialising the
      ``[batch, seq, vocab]`` float32 logits; ``null``: the plain loss.
    - ``data.batch_size``: sequences per microbatch across all devices; a step averages the
      gradients of ``grad_accum`` microbatches, so it sees
      ``batch_size * grad_accum * seq_len`` tokens. ``auto``: the largest that fits the device,
      by compile-only planning (``coat_jax.training.plan.resolve_batch``), with ``grad_accum``
      set to ``global_batch_size / batch_size`` where ``global_batch_size`` is set.
    - ``logging.wandb_project``, ``logging.wandb_mode``, ``logging.profile_steps``:
      ``coat_jax.training.metrics.WandbWriter`` and ``coat_jax.training.loop.StepTrace``.
    - ``optimizer.min_lr_ratio``: the cosine schedule ends at ``learning_rate * min_lr_ratio``.
    - ``optimizer.grad_clip``: global-norm clipping threshold, ``null`` for none.
    - ``optimizer.skip_nonfinite_steps``: a step whose gradient is not finite leaves the parameters
      and the optimizer state as they were (``coat_jax.training.optimizers.skip_nonfinite``); the
      run stops (exit code 3) at the step that would make one more than this many. 0: stop at the
      first.
    - ``optimizer.decay_norms_and_embeddings``: weight decay on every parameter instead of on
      matrices other than the embedding only.
    - ``optimizer.mu_format``/``optimizer.nu_format``: FP8 formats of coat_adamw's moments.
    - ``xla.compilation_cache_dir``: JAX's persistent compilation cache; ``null`` sets none
      (JAX's own ``JAX_COMPILATION_CACHE_DIR`` still applies).
    - ``xla.deterministic``: compile the training step and the evaluation with XLA's
      ``xla_gpu_deterministic_ops`` (``coat_jax.training.program.compiler_options``), meant to make
      a single-GPU run repeat bit for bit: scatters (the embedding's gradient) and reductions
      without atomics. It covers what XLA compiles; the Pallas kernels use no atomics; collectives
      across devices are not covered. The model's attention then runs as XLA's
      (``FP8Config.attention="xla"``, rematerialized) instead of cuDNN's. Slower; off by default. On
      a GPU two runs of a tiny COAT model with it repeat bit for bit
      (``tests/training/test_train.py::test_deterministic_gpu_runs_repeat_bit_for_bit``). With
      cuDNN's attention the BF16 and COAT steps failed to compile under the XLA option (cause not
      located), hence XLA's attention; an error of the first step under this option is reported as
      one that names it. The CPU backend is deterministic without it. Why it exists: two GPU runs of
      the same BF16 step did not repeat (docs/accuracy.md).
    - ``xla.excess_precision``: XLA's ``xla_allow_excess_precision`` for the training step and
      the evaluation (``coat_jax.training.program.compiler_options``). ``true`` (XLA's own default)
      lets XLA keep a bfloat16 intermediate in float32 between two fusions (it removes the
      round trip through bfloat16); ``false`` rounds every bfloat16 value the program names,
      so those tensors cross memory in 2 bytes instead of 4. ``null``: the measured default,
      ``false`` for precision ``coat`` on a GPU and XLA's own otherwise
      (``coat_jax.training.model.excess_precision``, docs/bench_excess_precision.md).
    - ``logging.telemetry``: add the optimizer state's quantization telemetry and (precision ``fp8``
      or ``coat``) the range of the FP8 activation scales to the metrics records written
      every ``log_every`` steps (and at the first and last step), computed on those steps
      only (``coat_jax.training.telemetry``, docs/telemetry.md).
    """

    # Run (top-level keys).
    recipe: Literal[tuple(recipes.RECIPES)] = recipes.DEFAULT
    steps: int = 600
    output_dir: str = "runs/default"
    resume: bool = False
    reschedule: bool = False
    overwrite: bool = False
    seed: int = 0
    init_from: str | None = None
    kernels: Kernels = "auto"
    model: LlamaConfig = dataclasses.field(default_factory=lambda: LlamaConfig(**DEFAULT_MODEL))
    # precision.*: the FP8 options take FP8Config's defaults (one default per option).
    precision: Literal[PRECISIONS] = "coat"
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    fp8_attention: bool = False
    fp8_attention_backward: Literal[ATTENTION_BACKWARDS] = _FP8_DEFAULTS.attention_backward
    fp8_weight_residual: Literal[WEIGHT_RESIDUALS] = _FP8_DEFAULTS.weight_residual
    fp8_group_scale: Literal[quant.SCALE_FORMATS] = _FP8_DEFAULTS.group_scale
    fp8_swiglu: Literal[SWIGLU_OPS] = _FP8_DEFAULTS.swiglu
    fp8_linear_scaling: Literal[LINEAR_SCALINGS] = _FP8_DEFAULTS.linear_scaling
    # memory.*
    scan_layers: bool = False
    remat: RematName = "none"
    loss_chunk_size: int | None = None
    # data.* (docs/data.md; check_data_keys checks these).
    data_path: str = DEFAULT_DATA_PATH
    sources: tuple[DataSource, ...] | None = None
    text_field: str = "text"
    attention_across_documents: bool | None = None
    document_positions: bool = False
    tokenizer: str = "byte"
    cache_dir: str = "~/.cache/coat_jax/tokens"
    val_fraction: float = 0.005
    val_documents: str | None = None
    seq_len: int = 128
    batch_size: int | Literal["auto"] = 16
    grad_accum: int = 1
    global_batch_size: int | None = None
    # optimizer.*
    # adamw, lion, sgd, adafactor, muon: optax's (coat_jax.training.optimizers documents how
    # each uses the keys below); coat_adamw: COAT's fused FP8 AdamW. fp8_state: store the optax
    # optimizer's parameter-shaped state in FP8 (coat_jax.fp8_state), mu_format for signed
    # state (momenta) and nu_format for non-negative state (second moments). momentum: sgd's
    # momentum and muon's decay.
    optimizer: Literal["adamw", "coat_adamw", "lion", "sgd", "adafactor", "muon"] = "coat_adamw"
    fp8_state: bool = False
    momentum: float = 0.9
    learning_rate: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    grad_clip: float | None = 1.0
    weight_decay: float = 0.1
    decay_norms_and_embeddings: bool = False
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    mu_format: Literal["e4m3", "e5m2"] = "e4m3"
    nu_format: Literal["e4m3", "e5m2"] = "e4m3"
    fused_apply: bool = True
    optimizer_in_backward: bool = False
    skip_nonfinite_steps: int = 0
    # checkpoint.*
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    save_final: bool = True
    # eval.*
    eval_every: int = 200
    eval_batches: int = 8
    eval_at_start: bool = False
    # logging.*
    log_every: int = 10
    progress_bar: bool = True
    tensorboard: bool = False
    wandb_project: str | None = None
    wandb_mode: Literal["online", "offline"] = "online"
    profile_steps: tuple[int, int] | None = None
    telemetry: bool = False
    sample_prompt: str | None = "It is a truth"
    sample_tokens: int = 64
    # xla.*
    compilation_cache_dir: str | None = "~/.cache/coat_jax/jax"
    deterministic: bool = False
    xla_excess_precision: bool | None = None
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    def __post_init__(self):
        _check_positive(
            self,
            "steps",
            "seq_len",
            "batch_size",
            "grad_accum",
            "log_every",
            "eval_every",
            "eval_batches",
            "checkpoint_every",
            "keep_checkpoints",
            "sample_tokens",
        )
        if self.loss_chunk_size is not None and self.loss_chunk_size <= 0:
            raise ValueError(
                f"memory.loss_chunk_size must be a positive integer or null (plain loss), got "
                f"{self.loss_chunk_size}"
            )
        if self.learning_rate <= 0:
            raise ValueError(f"optimizer.learning_rate must be > 0, got {self.learning_rate}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        # A warmup as long as the run shrinks (coat_jax.training.program.warmup_of).
        if self.warmup_steps < 0:
            raise ValueError(f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.global_batch_size is not None and self.global_batch_size <= 0:
            raise ValueError(
                f"data.global_batch_size must be positive or null, got {self.global_batch_size}"
            )
        if (
            self.profile_steps is not None
            and not 1 <= self.profile_steps[0] <= self.profile_steps[1]
        ):
            raise ValueError(
                f"logging.profile_steps must be [first, last] with 1 <= first <= last, got "
                f"{list(self.profile_steps)}"
            )
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"optimizer.grad_clip must be > 0 or null (off), got {self.grad_clip}")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("b1", "b2", "momentum"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name_of(name)} must be in [0, 1), got {getattr(self, name)}")
        if self.fp8_state and self.optimizer == "coat_adamw":
            raise ValueError(
                "optimizer.fp8_state=true wraps an optax optimizer, but coat_adamw already keeps "
                "FP8 moments; use optimizer.name=adamw optimizer.fp8_state=true, or "
                "optimizer.fp8_state=false"
            )
        # "once", the default, holds trivially for precision bf16 (no weight is quantized);
        # keeping forward's FP8 codes is asked for explicitly and would do nothing there.
        if self.fp8_weight_residual == "fp8" and self.precision == "bf16":
            raise ValueError(
                "precision.fp8_weight_residual=fp8 needs precision fp8 or coat (precision bf16 has "
                "no FP8 weights); set precision.fp8_weight_residual=once or master"
            )
        if self.precision == "bf16" and names_fp8_ops(self.kernels):
            raise ValueError(
                f"kernels={to_yaml(self.kernels)} picks the kernels of FP8 activation ops, and "
                "precision.mode=bf16 has none; use precision.mode=fp8 or coat, or set "
                "kernels.optimizer alone"
            )
        if self.fp8_group_scale != "float32" and not (
            self.precision == "coat" or (self.precision == "fp8" and self.fp8_attention)
        ):
            raise ValueError(
                f"precision.fp8_group_scale={self.fp8_group_scale} changes the 1x16 scales of FP8 "
                f"activations, and precision.mode={self.precision} with precision.fp8_attention="
                f"{str(self.fp8_attention).lower()} keeps none; use precision.mode=coat (or fp8 "
                "with precision.fp8_attention=true), or set precision.fp8_group_scale=float32"
            )
        if self.fp8_attention_backward != "recompute" and not self.fp8_attention:
            raise ValueError(
                f"precision.fp8_attention_backward={self.fp8_attention_backward} is an option of "
                "FP8 attention, and precision.fp8_attention=false runs attention in BF16; set "
                "precision.fp8_attention=true, or precision.fp8_attention_backward=recompute"
            )
        if self.fp8_swiglu != "coat" and self.precision != "coat":
            raise ValueError(
                f"precision.fp8_swiglu={self.fp8_swiglu} changes the FP8 SiLU and product of "
                f"precision coat, and precision.mode={self.precision} runs them in BF16; use "
                "precision.mode=coat, or set precision.fp8_swiglu=coat"
            )
        if self.fp8_linear_scaling != "tensor" and (
            self.precision == "bf16" or self.fp8_weight_residual != "master"
        ):
            raise ValueError(
                f"precision.fp8_linear_scaling={self.fp8_linear_scaling} re-quantizes master "
                f"weights in FP8 linears, and precision.mode={self.precision} with "
                f"precision.fp8_weight_residual={self.fp8_weight_residual} does not; use "
                "precision.mode=fp8 or coat with precision.fp8_weight_residual=master, or set "
                "precision.fp8_linear_scaling=tensor"
            )
        check_data_keys(self)
        for name in ("data", "fsdp"):
            size = getattr(self.mesh, name)
            if size == 0 or size < -1:
                raise ValueError(f"mesh.{name} must be a positive size or -1 (all), got {size}")
        if self.mesh.data == -1 and self.mesh.fsdp == -1:
            raise ValueError("at most one of mesh.data and mesh.fsdp may be -1")
        if self.resume and self.overwrite:
            raise ValueError(
                "resume=true continues the run in output_dir and overwrite=true deletes it; "
                "pass only one of them"
            )
        if self.skip_nonfinite_steps < 0:
            raise ValueError(
                f"optimizer.skip_nonfinite_steps must be >= 0 (0: stop at the first), got "
                f"{self.skip_nonfinite_steps}"
            )
        if self.optimizer_in_backward:
            _check_in_backward(self)
        # With init_from the architecture, max_position_embeddings included, is the
        # checkpoint's; the trainer checks it once it has read it.
        if self.init_from is None and self.seq_len > self.model.max_position_embeddings:
            raise ValueError(
                f"data.seq_len={self.seq_len} is longer than model.max_position_embeddings="
                f"{self.model.max_position_embeddings}; lower seq_len or raise "
                "model.max_position_embeddings"
            )

    @property
    def tokens_per_step(self) -> int:
        if self.batch_size == "auto":
            raise ValueError(
                "data.batch_size=auto is resolved by coat_jax.training.plan.resolve_batch"
            )
        return self.batch_size * self.grad_accum * self.seq_len


def _check_in_backward(cfg: TrainConfig) -> None:
    """What ``optimizer_in_backward`` cannot do: anything that needs the whole gradient first."""
    needs = {
        "scan_layers": (
            not cfg.scan_layers,
            "memory.scan_layers=true (the layers' backward is a scan)",
        ),
        "grad_clip": (
            cfg.grad_clip is not None,
            "optimizer.grad_clip=null (global-norm clipping needs every gradient before any "
            "update)",
        ),
        "grad_accum": (
            cfg.grad_accum != 1,
            "data.grad_accum=1 (each layer is updated once per step)",
        ),
        "skip_nonfinite_steps": (
            cfg.skip_nonfinite_steps != 0,
            "optimizer.skip_nonfinite_steps=0 (a layer is updated before the rest of the gradient "
            "exists)",
        ),
        "telemetry": (cfg.telemetry, "logging.telemetry=false (it reads the whole gradient)"),
    }
    bad = [fix for wrong, fix in needs.values() if wrong]
    if bad:
        raise ValueError("optimizer.in_backward=true needs " + "; ".join(bad))


def _check_positive(cfg, *names):
    for name in names:
        value = getattr(cfg, name)
        if value != "auto" and value <= 0:
            raise ValueError(f"{name_of(name)} must be a positive integer, got {value}")


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Builds a :class:`TrainConfig` from defaults, an optional YAML file and ``key=value`` items.

    Args:
      path: a YAML file; ``base: FILE`` inside it names a file (relative to it) to start from.
      overrides: ``key=value`` or ``section.key=value`` strings, applied last.

    Returns:
      The validated config.

    Raises:
      ValueError: unknown key (the message names close matches), a flat key
        (the message names its new name), bad value, or a base cycle.
    """
    raw: dict[str, Any] = {} if path is None else read_config_file(path)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key=value")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as e:
            raise ValueError(
                f"override {item!r}: the value is not valid YAML ({e.problem}); quote it, e.g. "
                f"{key}='\"{text}\"'"
            ) from None
        key = key.strip()
        if key.startswith("kernels."):
            raw["kernels"] = kernels_mapping(check_kernels(raw.get("kernels", "auto")))
        set_dotted(raw, key, value)
    return from_dict(raw)


def from_dict(raw: Mapping[str, Any]) -> TrainConfig:
    """Validates a mapping of sections (or dotted keys, ``{"precision.mode": "bf16"}``) and
    builds the :class:`TrainConfig`; keys it leaves out take the values of its ``recipe``
    (:mod:`coat_jax.recipes`), then defaults."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"config must be a mapping, got {raw!r}")
    _check_removed(raw)
    flat = flatten(raw)
    name = flat.get("recipe", recipes.DEFAULT)
    taken = {k: v for k, v in recipes.settings(name).items() if field_of(k) not in flat}
    try:
        return _build(TrainConfig, {**{field_of(k): v for k, v in taken.items()}, **flat}, "")
    except ValueError as e:
        if not taken or name == recipes.DEFAULT:
            raise
        raise ValueError(f"{e} (recipe {name} sets {', '.join(taken)})") from None


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The config as a file writes it: sections of plain YAML-safe values (lists, not tuples)."""
    flat = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}
    flat["kernels"] = to_yaml(cfg.kernels)
    return nest(flat)


# Keys and values the trainer no longer takes, with what replaced them: a config naming one is
# refused with this line, not with the close matches of an unknown key.
REMOVED_KEYS = {
    "fp8_codes_barrier": "fp8_codes_barrier was removed: the optimization barrier on the FP8 "
    "codes kept for backward is always on (off was slower, docs/bench_codes_barrier.md); "
    "delete the key",
    "fp8_gemm_output": "fp8_gemm_output was removed: the FP8 GEMMs always write BF16 "
    "activations themselves (a float32 result cast afterwards was slower, "
    "docs/bench_gemm_output.md); delete the key",
}
REMOVED_VALUES = {
    ("kernels", "interpret"): "kernels=interpret was removed: Pallas interpret mode is for "
    "tests, which set the environment variable COAT_JAX_PALLAS_INTERPRET=1; use kernels=auto, "
    "xla or pallas",
}


def _check_removed(raw: Mapping[str, Any]) -> None:
    for name, value in raw.items():
        removed = REMOVED_KEYS.get(name)
        if removed is None and isinstance(value, str):
            removed = REMOVED_VALUES.get((name, value))
        if removed is not None:
            raise ValueError(removed)


def _build(cls, raw: Mapping[str, Any], prefix: str):
    """``cls`` from ``raw``: TrainConfig from its flat fields (names its keys by their file
    names), a section's dataclass from its keys."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        close = {k: difflib.get_close_matches(str(k), fields, n=3) for k in unknown}
        hints = [
            f"did you mean {' or '.join(prefix + c for c in close[k])}?" for k in close if close[k]
        ]
        raise ValueError(
            f"unknown config key(s) {', '.join(prefix + str(k) for k in unknown)}; "
            f"{' '.join(hints) + ' ' if hints else ''}python train.py --help lists every key"
        )
    kwargs = dict(DEFAULT_MODEL) if cls is LlamaConfig else {}
    for name, value in raw.items():
        hint = hints[name]
        label = name_of(name) if cls is TrainConfig else prefix + name
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value if value is not None else {}, f"{prefix}{name}.")
        elif cls is TrainConfig and name == "kernels":
            kwargs[name] = check_kernels(value)
        elif (section := _section_of_list(hint)) is not None and value is not None:
            # A list of sections such as sources: each item is built and checked like a section.
            if not isinstance(value, list | tuple):
                raise ValueError(f"{label}={value!r} is not valid; expected a list of mappings")
            kwargs[name] = tuple(_build(section, v, f"{label}[{i}].") for i, v in enumerate(value))
        else:
            kwargs[name] = coerce(label, hint, value)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        if cls is TrainConfig:
            raise
        raise ValueError(f"{prefix.rstrip('.')}: {e}") from e


def _section_of_list(hint):
    """The dataclass of a ``tuple[Section, ...]`` (optionally ``| None``) field, else None."""
    for h in (hint, *typing.get_args(hint)):
        args = typing.get_args(h)
        if typing.get_origin(h) is tuple and args and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None
