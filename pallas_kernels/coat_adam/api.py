"""The public COAT AdamW step and fused apply, and the choice of implementation (through
:func:`pallas_kernels.dispatch.dispatch`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from pallas_kernels import stacks
from pallas_kernels.coat_adam.config import KernelConfig, MomentSpec
from pallas_kernels.coat_adam.pallas_triton import hyper_vector
from pallas_kernels.coat_adam.reference import (
    check_view,
    coat_adam_step_reference,
    coat_adamw_apply_reference,
)
from pallas_kernels.coat_adam.sharded import sharded_call
from pallas_kernels.dispatch import dispatch
from pallas_kernels.quant import QuantizedTensor
from pallas_kernels.sharding import view_spec


def _check_kernel_spec(spec: MomentSpec) -> None:
    """``NotImplementedError`` unless the kernel handles ``spec``: Triton tiles need a
    power-of-two group size."""
    if spec.group_size & (spec.group_size - 1):
        raise NotImplementedError(
            f"the Pallas kernel needs a power-of-two group_size, got {spec.group_size}"
        )


def _check_placement(mesh, partition) -> None:
    if (mesh is None) != (partition is None):
        raise ValueError(
            "mesh and partition go together: pass both (the parameter's PartitionSpec on that "
            f"mesh) or neither; got mesh={mesh!r}, partition={partition!r}"
        )


def _in_view(grad, partition, view):
    """The gradient and its split in the moments' group view ``view`` (a free reshape)."""
    if partition is not None:
        partition = view_spec(partition, grad.shape, view)
    return grad.reshape(view), partition


def coat_adam_step(
    grad: jax.Array,
    mu: QuantizedTensor,
    nu: QuantizedTensor,
    *,
    count,
    b1,
    b2,
    eps,
    expand_min,
    spec: MomentSpec,
    implementation: str = "auto",
    interpret: bool = False,
    config: KernelConfig | None = None,
    mesh: Mesh | None = None,
    partition: PartitionSpec | None = None,
) -> tuple[jax.Array, QuantizedTensor, QuantizedTensor]:
    """COAT AdamW step of one parameter on the chosen implementation (see module docstring).

    ``"auto"`` runs the kernel on a GPU when the group size is a power of two (COAT's 128 is)
    and the placement is known (one device, or ``mesh`` given), the reference otherwise;
    ``"pallas"`` raises ``ValueError`` where the kernel cannot run.

    Args:
      mesh, partition: the mesh the parameter is sharded over and its ``PartitionSpec`` (both or
        neither): the kernel then runs on each shard. The reference needs neither.
      config: kernel launch settings (``None``: :data:`DEFAULT_CONFIG`).
      Others: as in :func:`coat_adam_step_reference`.
    """
    _check_placement(mesh, partition)
    kwargs = dict(count=count, b1=b1, b2=b2, eps=eps, expand_min=expand_min, spec=spec)
    return dispatch(
        "coat_adam_step",
        implementation,
        interpret=interpret,
        mesh=mesh,
        pallas=lambda: _step_in_view(grad, mu, nu, interpret, config, mesh, partition, kwargs),
        xla=lambda: coat_adam_step_reference(grad, mu, nu, **kwargs),
    )[1]


def _step_in_view(grad, mu, nu, interpret, config, mesh, partition, kwargs):
    """:func:`coat_adam_step_pallas` on the gradient in the moments' group view, its update
    back in the gradient's shape."""
    check_view(grad.shape, mu, nu)
    grad_v, partition = _in_view(grad, partition, mu.shape)
    update, new_mu, new_nu = coat_adam_step_pallas(
        grad_v,
        mu,
        nu,
        interpret=interpret,
        config=config,
        mesh=mesh,
        partition=partition,
        **kwargs,
    )
    return update.reshape(grad.shape), new_mu, new_nu


def coat_adam_step_pallas(
    grad: jax.Array,
    mu: QuantizedTensor,
    nu: QuantizedTensor,
    *,
    count,
    b1,
    b2,
    eps,
    expand_min,
    spec: MomentSpec,
    interpret: bool = False,
    config: KernelConfig | None = None,
    mesh: Mesh | None = None,
    partition: PartitionSpec | None = None,
) -> tuple[jax.Array, QuantizedTensor, QuantizedTensor]:
    """The fused kernel version of :func:`coat_adam_step_reference` (same arguments, same result
    to float32 rounding; codes equal except at rounding ties), with the gradient (and
    ``partition``) in the moments' shape: :func:`coat_adam_step` reshapes them to it.

    ``interpret=True`` runs the kernel body through XLA (CPU tests); ``config`` sets the launch
    (``None``: :data:`DEFAULT_CONFIG`); ``mesh`` and ``partition`` run it on each shard. Raises
    ``NotImplementedError`` for a group size that is not a power of two, or off a GPU without
    ``interpret``.
    """
    _check_placement(mesh, partition)
    _check_kernel_spec(spec)
    hyper = hyper_vector(count=count, b1=b1, b2=b2, eps=eps, expand_min=expand_min, spec=spec)
    return sharded_call(
        grad,
        None,
        mu,
        nu,
        hyper,
        spec=spec,
        config=config,
        interpret=interpret,
        mesh=mesh,
        partition=partition,
    )


def _no_spec(kwargs):
    return {k: v for k, v in kwargs.items() if k != "spec"}


def coat_adamw_apply(
    param: jax.Array,
    grad: jax.Array,
    mu: QuantizedTensor,
    nu: QuantizedTensor,
    *,
    count,
    b1,
    b2,
    eps,
    expand_min,
    learning_rate,
    weight_decay,
    spec: MomentSpec,
    grad_scale=None,
    implementation: str = "auto",
    interpret: bool = False,
    config: KernelConfig | None = None,
    mesh: Mesh | None = None,
    partition: PartitionSpec | None = None,
    index=None,
) -> tuple[jax.Array, QuantizedTensor, QuantizedTensor]:
    """One whole COAT AdamW step of one parameter: ``(new_param, new_mu, new_nu)``.

    The same result as ``coat_adamw``'s update followed by ``optax.apply_updates`` (for a
    non-zero weight decay, see :func:`apply_update`), but on the kernel path in one pass that
    reads the parameter and writes the new one in place: about 14 bytes per parameter with bf16
    gradients, against 18 for the update followed by XLA's apply (docs/optimizer_kernel.md,
    'The bytes it must move').

    Args:
      param: the parameter (float32 master weights, typically).
      grad: its gradient, the parameter's shape, any float dtype.
      mu, nu: the quantized moments, in the parameter's group view (its shape or a reshape of
        it, see :func:`coat_adam_step_reference`).
      count: the step number t, starting at 1.
      b1, b2, eps, expand_min, learning_rate, weight_decay: numeric hyper-parameters (traced
        values are fine: they reach the kernel as operands).
      spec: static quantization settings.
      grad_scale: a scalar the gradient is multiplied by first, in float32 (``None``: 1), so that
        a global-norm clip costs no pass of its own over the gradient
        (``coat_jax.optim.clip_by_global_norm``); traced values are fine.
      implementation, interpret, mesh, partition: as in :func:`coat_adam_step`; ``partition``
        is the gradient's (one element's) with ``index``.
      config: kernel launch settings (``None``: :data:`DEFAULT_CONFIG`).
      index: ``None``, or an integer scalar (traced is fine): then ``param``, ``mu`` and ``nu``
        are stacks ``[L, *grad.shape]`` (a scanned model's layers and their state) and the step
        updates their element ``index`` in place, returning the whole stacks with the other
        elements unchanged. The kernel reads and writes that element inside the stacks (the
        stacks are aliased to the outputs), so a training step that donates them copies
        nothing; for a last axis that is not a multiple of the group size it steps the
        element's slices and writes them back, as the XLA path always does.
    """
    _check_placement(mesh, partition)
    kwargs = dict(count=count, b1=b1, b2=b2, eps=eps, expand_min=expand_min, spec=spec)
    decay = dict(learning_rate=learning_rate, weight_decay=weight_decay)
    scale = dict(grad_scale=grad_scale)
    stacked = index is not None
    if stacked and (param.ndim != grad.ndim + 1 or param.shape[1:] != grad.shape):
        raise ValueError(
            f"with index, param must be a stack [L, *grad.shape]; got param {param.shape} for "
            f"grad {grad.shape}"
        )
    if stacked and not jnp.issubdtype(jnp.asarray(index).dtype, jnp.integer):
        raise TypeError(f"index must be an integer scalar, got {jnp.asarray(index).dtype}")

    def kernel(param, mu, nu, in_place):
        # The kernel sees the parameter and its gradient in the moments' group view.
        view = mu.shape[1:] if in_place else mu.shape
        grad_v, split = _in_view(grad, partition, view)
        hyper = hyper_vector(
            spec=spec, **decay, **scale, **_no_spec(kwargs), index=index if in_place else None
        )
        new_param, new_mu, new_nu = sharded_call(
            grad_v,
            param.reshape(mu.shape),
            mu,
            nu,
            hyper,
            spec=spec,
            config=config,
            interpret=interpret,
            mesh=mesh,
            partition=split,
            stacked=in_place,
        )
        return new_param.reshape(param.shape), new_mu, new_nu

    def pallas():
        _check_kernel_spec(spec)
        if not stacked and param.shape != grad.shape:
            raise ValueError(f"param shape {param.shape} differs from grad shape {grad.shape}")
        if not jnp.issubdtype(param.dtype, jnp.floating):
            raise TypeError(f"param must be a float array, got {param.dtype}")
        check_view(param.shape, mu, nu)
        if stacked and mu.shape[-1] % spec.group_size:
            # The in-place kernel takes whole groups only (fused_call): a short last group
            # steps the element's slices with the per-parameter kernel and writes them back.
            return stacks.step_element(lambda t: kernel(*t, in_place=False), (param, mu, nu), index)
        return kernel(param, mu, nu, in_place=stacked)

    def xla():
        if not stacked:
            return coat_adamw_apply_reference(param, grad, mu, nu, **decay, **scale, **kwargs)
        return stacks.step_element(
            lambda t: coat_adamw_apply_reference(*t[:1], grad, *t[1:], **decay, **scale, **kwargs),
            (param, mu, nu),
            index,
        )

    return dispatch(
        "coat_adamw_apply",
        implementation,
        interpret=interpret,
        mesh=mesh,
        pallas=pallas,
        xla=xla,
    )[1]
