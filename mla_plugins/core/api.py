"""The public entry points: `plan_prefill`, `mla_prefill`, `mla_reduce`, `available_kernels`,
`unsupported_reasons`, `lse_heads_first`.

The core reads in one direction: `plan` (the plan and the planner) <- `kernels` (each kernel
plans and runs) <- `registry` (finds the kernels, chooses one) <- `api` (this module: checks
the arguments, asks the registry, plans, runs). Choosing a kernel for a batch is done here,
one floor above the plan.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import replace

import torch

from .device import fp8_dtype_for
from .fp8 import outliers_apply, rotation_applies
from .kernels.base import ConfigInputs, KernelInfo, PlanRequest, PrefillInputs, ReduceInputs
from .plan import PrefillPlan, host_offsets, normalize_device
from .registry import get_registry
from .settings import pinned_kernel
from .trace import record_prefill, tracing
from .validation import (
    FLOAT_DTYPES,
    MAX_NUM_HEADS,
    MAX_TILE_Q,
    check_bool,
    check_device,
    check_dims_positive,
    check_dtype,
    check_nonnegative_int,
    check_not_meta,
    check_plan_param,
    check_positive_int,
    check_reduce_maps,
    check_same_device,
    check_tensor,
    check_writable_layout,
)


def plan_prefill(
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    num_heads: int,
    causal: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    fp8: bool | None = None,
    head_dim_qk: int = 192,
    head_dim_v: int = 128,
    kernel: str = "auto",
    tile_q: int | None = None,
    kv_granularity: int | None = None,
    num_workers: int | None = None,
    fp8_outliers: bool | None = None,
) -> PrefillPlan:
    """Plan the split-KV prefill of one varlen batch, for the kernel that will run it.

    cu_seqlens_q, cu_seqlens_k: offsets [B+1] from 0, non-decreasing, given on the host
    (lists/tuples of ints, CPU int tensors: no device read) or as int32 device tensors
    (then read once, both together). `device` is where the plan and the run live
    (default: the offsets' device). `kernel="auto"` picks the kernel for this batch as
    `mla_prefill` would (dtype, fp8, head dims, MLA_PLUGINS_KERNEL) and plans with its own
    parameters; `tile_q`, `kv_granularity` and `num_workers` override those parameters.
    fp8=None plans for either compute mode (selection as for fp8=True). `fp8_outliers`
    (None: MLA_PLUGINS_FP8_OUTLIERS) plans for calls that keep the outlier features out of
    the fp8 cast: kernel="auto" then passes over the kernels that cannot (mla_prefill's
    `fp8_outliers`), so that a framework that sets the variable plans for a kernel that
    runs its calls.
    """
    cq, ck = host_offsets(cu_seqlens_q, cu_seqlens_k)
    check_positive_int("num_heads", num_heads)
    if num_heads >= 1 << 15:
        raise ValueError(f"num_heads: found {num_heads}, expected fewer than 32768")
    for name, flag in (("causal", causal), ("fp8", fp8)):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"{name}: found {type(flag).__name__}, expected bool")
    check_positive_int("head_dim_qk", head_dim_qk)
    check_positive_int("head_dim_v", head_dim_v)
    outliers = outliers_apply(head_dim_qk, fp8_outliers, fp8 is not False)
    overrides = {}
    for name, value in (("tile_q", tile_q), ("kv_granularity", kv_granularity),
                        ("num_workers", num_workers)):
        if value is not None:
            check_plan_param(name, value)  # bounded: a huge worker count would hang the planner
            overrides[name] = value
    if device is None:
        device = cu_seqlens_q.device if isinstance(cu_seqlens_q, torch.Tensor) else "cpu"
    request = PlanRequest(
        seqlens_host=(tuple(cq), tuple(ck)),
        num_heads=num_heads,
        causal=causal,
        device=normalize_device(device),
        dtype=dtype,
        fp8=True if fp8 is None else fp8,
        fp8_given=fp8 is not None,
        head_dim_qk=head_dim_qk,
        head_dim_v=head_dim_v,
        overrides=overrides,
        fp8_outliers=outliers,
    )
    chosen, run_fp8 = get_registry().choose(request, kernel, allow_bf16=fp8 is True)
    auto_bf16 = fp8 is True and not run_fp8
    if auto_bf16:
        request = replace(request, fp8=False)
    plan = chosen.build_plan(request)
    if auto_bf16:
        plan = replace(plan, auto_bf16=True)
    plan.memo["kernel"] = chosen
    return plan




_CACHE_SIZE = 16
_cache: OrderedDict[tuple, PrefillPlan] = OrderedDict()
_cache_lock = threading.Lock()


def cached_plan(host, *, num_heads: int, causal: bool, device: torch.device, dtype: torch.dtype,
                fp8: bool, head_dim_qk: int, head_dim_v: int, kernel) -> PrefillPlan:
    """The plan of `kernel` for a call without one, remembered by batch.

    A framework calls the prefill once per layer with the same batch: the plan is built
    on the first layer and found by its sequence lengths (read once per call) after.
    """
    key = (host, num_heads, causal, str(device), dtype, fp8, head_dim_qk, head_dim_v, kernel.name)
    with _cache_lock:
        plan = _cache.get(key)
        if plan is not None:
            _cache.move_to_end(key)
            return plan
    request = PlanRequest(
        seqlens_host=host, num_heads=num_heads, causal=causal, device=device, dtype=dtype,
        fp8=fp8, fp8_given=True, head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, overrides={},
    )
    plan = kernel.build_plan(request)
    plan.memo["kernel"] = kernel
    with _cache_lock:
        _cache[key] = plan
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return plan


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    # Kernels index tokens and heads by stride but want the feature dim dense (the common,
    # contiguous case is the cheaper read, so it comes first: a planned call's hot path)
    return t if t.is_contiguous() or t.stride(-1) == 1 else t.contiguous()


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=3)
        if t.dtype not in FLOAT_DTYPES:
            hint = " (pass bf16/fp16; fp8=True quantizes inside the kernel)" if t.dtype.is_floating_point else ""
            raise TypeError(f"{name}: found dtype {t.dtype}, expected torch.bfloat16 or torch.float16{hint}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"k, v: found dtypes {k.dtype}, {v.dtype}, expected {q.dtype} like q")
    check_not_meta("q", q)  # meta tensors hold no data: torch fails deep inside otherwise
    check_same_device("q", q, k=k, v=v)
    check_dims_positive("q", q, {2: "head dim"})  # the default scale divides by it
    check_dims_positive("v", v, {2: "value head dim"})
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(
            f"k, v: found {k.shape[1]} and {v.shape[1]} heads, expected {q.shape[1]} like q "
            "(MLA prefill is MHA over the decompressed keys: one key/value head per query head)"
        )
    if q.shape[1] < 1:
        raise ValueError("q: found 0 heads, expected at least 1")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k: found head dim {k.shape[2]}, expected {q.shape[2]} like q ([total_k, H, Dqk])")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v: found {v.shape[0]} tokens, expected {k.shape[0]} like k ([total_k, H, Dv])")


def _scale(softmax_scale, q) -> float:
    if softmax_scale is None:
        return q.shape[2] ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale: found {type(softmax_scale).__name__}, expected a float or None")
    try:
        scale = float(softmax_scale)
    except OverflowError:  # an int past the float range (10**400): its digits are not printed
        raise ValueError(f"softmax_scale: found an int of {softmax_scale.bit_length()} bits, beyond "
                         "the float range, expected a finite float > 0") from None
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale: found {softmax_scale}, expected a finite float > 0")
    return scale


def _read_offsets(cu_seqlens_q, cu_seqlens_k, q) -> tuple[list[int], list[int]]:
    """Host copies of the offsets of a call without a plan: at most one device read."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise TypeError(
            "cu_seqlens_q, cu_seqlens_k: found None, expected int32 offsets [B+1] "
            "(they may be left out only with plan=plan_prefill(...))"
        )
    # device tensors must be on q's device; host offsets (lists, CPU tensors) are fine
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            check_same_device("q", q, **{name: t})
    return host_offsets(cu_seqlens_q, cu_seqlens_k, cpu_int64=False)


def _prefill_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, fp8, plan,
                    fp8_rotate=None, fp8_outliers=None) -> PrefillInputs:
    """Checked inputs of one call. With a plan the offsets come from the plan (the caller's
    `cu_seqlens_q`/`cu_seqlens_k`, if any, are not read); without one they are read once."""
    if plan is not None and not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan: found {type(plan).__name__}, expected a PrefillPlan from plan_prefill()")
    _check_qkv(q, k, v)
    softmax_scale = _scale(softmax_scale, q)
    if plan is not None:
        if causal is None:
            causal = plan.causal
        if fp8 is None:
            fp8 = True if plan.fp8 is None else plan.fp8
    else:
        causal = True if causal is None else causal
        fp8 = True if fp8 is None else fp8
    for name, flag in (("causal", causal), ("fp8", fp8)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: found {type(flag).__name__}, expected bool")
    if fp8_rotate is not None and not isinstance(fp8_rotate, bool):
        raise TypeError(f"fp8_rotate: found {type(fp8_rotate).__name__}, expected bool or None")
    outliers = outliers_apply(q.shape[2], fp8_outliers, fp8)
    rotate = fp8 and rotation_applies(q.shape[2], fp8_rotate, outliers)
    if plan is not None:
        found = (plan.total_q, plan.total_k, plan.num_heads, plan.causal)
        expected = (q.shape[0], k.shape[0], q.shape[1], causal)
        if found != expected:
            raise ValueError(
                f"plan: found (total_q, total_k, num_heads, causal) = {found}, expected {expected}; "
                "build it with plan_prefill() from these cu_seqlens, num_heads and causal"
            )
        if plan.auto_bf16 and fp8:
            fp8 = False  # kernel="auto" measured bf16 faster for this batch (plan_prefill)
            rotate = outliers = False
        if plan.fp8 is not None and plan.fp8 != fp8:
            raise ValueError(
                f"fp8: found {fp8}, expected {plan.fp8} like the plan (plan_prefill(fp8=...)); "
                "plan with the compute mode of the call, or with fp8=None for either"
            )
        if plan.device != q.device:
            raise ValueError(f"plan: found a plan for {plan.device}, expected {q.device} (q's device)")
        fp8_dtype = fp8_dtype_for(q.device)
        return PrefillInputs(
            q=_unit_stride(q), k=_unit_stride(k), v=_unit_stride(v),
            cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k,
            softmax_scale=softmax_scale, causal=causal, fp8=fp8, fp8_dtype=fp8_dtype,
            max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_k,
            seqlens_host=plan.cu_seqlens_host, fp8_rotate=rotate, fp8_outliers=outliers,
        )
    cq, ck = _read_offsets(cu_seqlens_q, cu_seqlens_k, q)
    if cq[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens_q: found total {cq[-1]}, expected {q.shape[0]} (q.shape[0])")
    if ck[-1] != k.shape[0]:
        raise ValueError(f"cu_seqlens_k: found total {ck[-1]}, expected {k.shape[0]} (k.shape[0])")
    lens_q = [b - a for a, b in zip(cq, cq[1:], strict=False)]
    lens_k = [b - a for a, b in zip(ck, ck[1:], strict=False)]
    return PrefillInputs(
        q=_unit_stride(q),
        k=_unit_stride(k),
        v=_unit_stride(v),
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        softmax_scale=softmax_scale,
        causal=causal,
        fp8=fp8,
        fp8_dtype=fp8_dtype_for(q.device),
        max_seqlen_q=max(lens_q, default=0),
        max_seqlen_k=max(lens_k, default=0),
        seqlens_host=(tuple(cq), tuple(ck)),
        fp8_rotate=rotate,
        fp8_outliers=outliers,
    )


def _plans_kernel(plan: PrefillPlan):
    """The kernel that built `plan` (`plan.kernel`), found once and remembered by the plan."""
    chosen = plan.memo.get("kernel")
    if chosen is None:
        chosen = plan.memo["kernel"] = get_registry().get(plan.kernel, source="plan.kernel")
    return chosen


def _kernel_for_plan(plan: PrefillPlan, inputs: PrefillInputs, kernel: str):
    """The plan's own kernel for kernel="auto" (no new selection per call); a named kernel
    (or an input dtype the plan was not made for) is selected as without a plan."""
    if kernel == "auto" and inputs.dtype == plan.dtype:
        return _plans_kernel(plan)
    chosen = get_registry().select(inputs, kernel)
    if chosen.name != plan.kernel and plan.extra:
        raise ValueError(
            f"plan: found a plan of kernel {plan.kernel!r} with its own metadata, expected one "
            f"{chosen.name!r} can run; build it with plan_prefill(..., kernel={chosen.name!r})"
        )
    return chosen


def _call_signature(q, k, v, softmax_scale, out, lse) -> tuple:
    """What the checks of a planned call depend on, besides the flags (compared by identity:
    causal=1 equals True but must still be refused) and the plan itself."""
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
            softmax_scale, type(softmax_scale),
            None if out is None else (out.shape, out.stride(), out.dtype, out.device),
            None if lse is None else (lse.shape, lse.stride(), lse.dtype, lse.device))


def _run(chosen, inputs: PrefillInputs, plan: PrefillPlan, out, return_lse: bool, workspace,
         lse=None):
    """The chosen kernel's run into `out`; lse [total_q, H] (the caller's `lse`, written by
    the kernel's run; else the kernel's own where it has one: `Kernel.run_with_lse`) or None."""
    if lse is not None:
        chosen.run(inputs, plan, out, lse, workspace)
        return lse
    if return_lse:
        return chosen.run_with_lse(inputs, plan, out, workspace)
    chosen.run(inputs, plan, out, None, workspace)
    return None


def _planned_call(q, k, v, softmax_scale, causal, fp8, out, return_lse, plan, workspace,
                  fp8_rotate, lse, fp8_outliers):
    """A layer's call of a batch whose arguments look like one this plan accepted: every
    check of the full path is a function of the signature, the flags and the plan, so none
    is repeated (the per-call host cost of a serving loop). None: take the full path."""
    memo = plan.memo.get("call")
    if (memo is None or memo[1] is not causal or memo[2] is not fp8 or memo[3] is not return_lse
            or memo[5] is not fp8_rotate or memo[6] is not fp8_outliers):
        return None
    try:
        signature = _call_signature(q, k, v, softmax_scale, out, lse)
    except AttributeError:  # not tensors: the full path names the argument
        return None
    if signature != memo[0]:
        return None
    given_fp8 = fp8
    chosen, scale, causal, fp8, fp8_dtype, out_shape, rotate, outliers = memo[4]
    inputs = PrefillInputs(
        _unit_stride(q), _unit_stride(k), _unit_stride(v), plan.cu_seqlens_q, plan.cu_seqlens_k, scale, causal, fp8,
        fp8_dtype, plan.max_seqlen_q, plan.max_seqlen_k, plan.cu_seqlens_host, rotate, outliers,
    )
    if out is None:
        out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    lse = _run(chosen, inputs, plan, out, return_lse, workspace, lse)
    if tracing():
        record_prefill(kernel=chosen.name, fp8=inputs.fp8, q_tokens=out_shape[0], k_tokens=plan.total_k,
                       heads=out_shape[1], auto_bf16=plan.auto_bf16 and given_fp8 is True)
    return (out, lse) if return_lse else out


def mla_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    *,
    softmax_scale: float | None = None,
    causal: bool | None = None,
    fp8: bool | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    plan: PrefillPlan | None = None,
    kernel: str = "auto",
    workspace: torch.Tensor | None = None,
    fp8_rotate: bool | None = None,
    lse: torch.Tensor | None = None,
    fp8_outliers: bool | None = None,
):
    """Varlen MLA prefill attention (MHA form), split-KV planned and LSE-reduced.

    q: [total_q, H, Dqk], k: [total_k, H, Dqk], v: [total_k, H, Dv], bf16 or fp16.
    With `plan=plan_prefill(...)` (one per batch, reused by every layer) the offsets are the
    plan's: `cu_seqlens_q`/`cu_seqlens_k` may be omitted and are not read if given, nothing
    is read back from the device, and scratch comes from the workspace, so the call can be
    captured in a CUDA graph. Without a plan they are required (int32 [B+1] on q's device,
    or host lists) and read once per call (one device sync), and a plan is built or reused.
    Causal masking is bottom-right aligned: row i of a sequence with q_len rows and k_len
    keys sees keys j <= i + (k_len - q_len) (a cached prefix of k_len - q_len tokens).
    causal / fp8 default to the plan's (else True) and must agree with it.
    fp8=True quantizes q, k, v with dynamic scales and computes in fp8.
    workspace: uint8 [>= plan.workspace_bytes] on q's device, or None for the device's
    shared one (grown when needed, reused). Returns out [total_q, H, Dv] in q's dtype, or
    (out, lse) with lse float32 [total_q, H] (natural log) for every row when
    return_lse=True (through the flash_attn provider a view of FA3's own [H, total_q]
    tensor: `lse.t()` is contiguous, so a caller wanting that layout copies nothing).
    lse: with return_lse=True, float32 [total_q, H] on q's device, any strides but 0 (e.g.
    a contiguous one for a caller that needs [total_q, H] dense), written in place and
    returned: the one copy a layout other than the kernel's own costs, made by the kernel.
    Rows that see no key: 0 and -inf.
    fp8_rotate: in fp8, multiply q and k by core/fp8.py's orthonormal rotation before the cast
    (the same logits; outlier features no longer dominate the rounding). None:
    MLA_PLUGINS_FP8_ROTATE (default off: its measured cost, README) for a 192-wide query/key head.
    fp8_outliers: in fp8, correct the fp8 rounding of each (sequence, head)'s 8 largest
    features of q and k (by amax|q_f| * amax|k_f|): their products to ~8 significant bits,
    by one more 32-deep fp8 product per key block (core/fp8.py; not with fp8_rotate=True,
    and fp8_rotate=None then means no rotation). Kernels that cannot (flash_attn, aiter) are
    passed over by kernel="auto" and refuse it when pinned. None: MLA_PLUGINS_FP8_OUTLIERS
    (default off: its cost, README).
    """
    if plan is not None and type(plan) is PrefillPlan and (
            kernel == "auto" or kernel == plan.kernel):
        result = _planned_call(q, k, v, softmax_scale, causal, fp8, out, return_lse, plan, workspace,
                               fp8_rotate, lse, fp8_outliers)
        if result is not None:
            return result
    given = (plan, softmax_scale, causal, fp8, out, fp8_rotate, lse, fp8_outliers)
    inputs = _prefill_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, fp8, plan,
                             fp8_rotate, fp8_outliers)
    out_shape = (q.shape[0], q.shape[1], v.shape[2])
    if out is not None:
        check_tensor("out", out, ndim=3)
        if tuple(out.shape) != out_shape or out.dtype != q.dtype:
            raise ValueError(
                f"out: found {tuple(out.shape)} {out.dtype}, expected {out_shape} {q.dtype} "
                "([total_q, H, Dv] in q's dtype)"
            )
        check_same_device("q", q, out=out)
        check_writable_layout("out", out)  # also refuses expanded (stride 0) views
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: found {type(return_lse).__name__}, expected bool")
    if lse is not None:
        if not return_lse:
            raise ValueError("lse: given with return_lse=False, expected return_lse=True (lse is "
                             "written and returned beside out) or no lse")
        check_tensor("lse", lse, ndim=2, dtypes=(torch.float32,))
        if tuple(lse.shape) != out_shape[:2]:
            raise ValueError(f"lse: found {tuple(lse.shape)}, expected {out_shape[:2]} "
                             "([total_q, H])")
        check_same_device("q", q, lse=lse)
        check_writable_layout("lse", lse, unit_last=False)  # refuses expanded (stride 0) views
    if plan is not None:
        chosen = _kernel_for_plan(plan, inputs, kernel)
        if inputs.fp8_outliers and not chosen.supports_fp8_outliers:
            raise ValueError(
                f"fp8_outliers: found True, but the plan's kernel {chosen.name!r} casts every "
                "feature of q and k to fp8; plan with a kernel that keeps the outlier features "
                "out (plan_prefill(..., kernel='torch') or 'triton'), or pass fp8_outliers=False"
            )
    else:
        chosen, run_fp8 = get_registry().choose(inputs, kernel, allow_bf16=inputs.fp8)
        if inputs.fp8 and not run_fp8:
            inputs = replace(inputs, fp8=False, fp8_rotate=False, fp8_outliers=False)
        plan = cached_plan(
            inputs.seqlens_host, num_heads=inputs.num_heads, causal=inputs.causal,
            device=inputs.device, dtype=inputs.dtype, fp8=inputs.fp8,
            head_dim_qk=inputs.head_dim_qk, head_dim_v=inputs.head_dim_v, kernel=chosen,
        )
        inputs = replace(inputs, cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k)
    if out is None:
        out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    lse = _run(chosen, inputs, plan, out, return_lse, workspace, lse)
    if tracing():
        record_prefill(kernel=chosen.name, fp8=inputs.fp8, q_tokens=q.shape[0], k_tokens=k.shape[0],
                       heads=q.shape[1], auto_bf16=given[3] is True and not inputs.fp8 and (
                           plan.auto_bf16 or kernel == "auto"))
    if (given[0] is not None and kernel in ("auto", plan.kernel) and inputs.dtype == plan.dtype
            and chosen is plan.memo.get("kernel")):
        # every check above passed for this signature: the batch's next layers skip them
        _, scale, causal_given, fp8_given, out_given, rotate_given, lse_given, outliers_given = given
        plan.memo["call"] = (
            _call_signature(q, k, v, scale, out_given, lse_given), causal_given, fp8_given,
            return_lse,
            (chosen, inputs.softmax_scale, inputs.causal, inputs.fp8, inputs.fp8_dtype, out_shape,
             inputs.fp8_rotate, inputs.fp8_outliers),
            rotate_given, outliers_given,
        )
    return (out, lse) if return_lse else out


def mla_reduce(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor | None,
    reduce_partial_map: torch.Tensor,
    tile_q: int,
    num_kv_splits: int,
    out: torch.Tensor,
    final_lse: torch.Tensor | None = None,
    *,
    kernel: str = "auto",
    validate: bool | None = None,
) -> None:
    """Merge split-KV pieces by log-sum-exp, in place (AITER's post-#3391 argument order).

    partial_out: fp32 [P, H, Dv], partial_lse: fp32 [P, H], reduce_indptr: int32 [T+1],
    reduce_final_map: int32 [T, 2] (q_start, q_end) or None, reduce_partial_map: int32 [n]
    (first partial row of each piece), out: [total_q, H, Dv] bf16/fp16, final_lse: fp32
    [total_q, H] or None. Tiles have at most `tile_q` rows.
    num_kv_splits >= 0 is accepted for AITER's signature (AITER sizes its kernel's
    per-tile scratch with it; 0 = its default); the torch and Triton reduces do not read it.

    The index values of the maps (offsets, output rows, partial rows) are checked when the
    maps are on the host; for maps on a GPU that would cost a device read, so they are
    checked only with `validate=True` (`validate=False` skips the check everywhere).
    """
    check_tensor("partial_out", partial_out, ndim=3, dtypes=(torch.float32,))
    check_tensor("partial_lse", partial_lse, ndim=2, dtypes=(torch.float32,))
    check_tensor("reduce_indptr", reduce_indptr, ndim=1, dtypes=(torch.int32,))
    if reduce_final_map is not None:
        check_tensor("reduce_final_map", reduce_final_map, ndim=2, dtypes=(torch.int32,))
    check_tensor("reduce_partial_map", reduce_partial_map, ndim=1, dtypes=(torch.int32,))
    check_tensor("out", out, ndim=3, dtypes=FLOAT_DTYPES)
    if final_lse is not None:
        check_tensor("final_lse", final_lse, ndim=2, dtypes=(torch.float32,))
    check_positive_int("tile_q", tile_q, maximum=MAX_TILE_Q)
    check_nonnegative_int("num_kv_splits", num_kv_splits)
    if validate is not None:
        check_bool("validate", validate)
    check_not_meta("out", out)
    check_same_device(
        "out", out, partial_out=partial_out, partial_lse=partial_lse, reduce_indptr=reduce_indptr,
        reduce_final_map=reduce_final_map, reduce_partial_map=reduce_partial_map, final_lse=final_lse,
    )
    check_dims_positive("out", out, {1: "heads", 2: "value head dim"})
    heads, dv = out.shape[1], out.shape[2]
    if tuple(partial_out.shape[1:]) != (heads, dv):
        raise ValueError(
            f"partial_out: found {tuple(partial_out.shape)}, expected [P, {heads}, {dv}] "
            "(heads and value dim of out)"
        )
    if tuple(partial_lse.shape) != tuple(partial_out.shape[:2]):
        raise ValueError(
            f"partial_lse: found {tuple(partial_lse.shape)}, expected {tuple(partial_out.shape[:2])} "
            "([P, H] like partial_out)"
        )
    if reduce_indptr.numel() < 1:
        raise ValueError("reduce_indptr: found an empty tensor, expected [T+1] offsets")
    if reduce_final_map is not None and (
        reduce_final_map.shape[1] != 2 or reduce_final_map.shape[0] < reduce_indptr.numel() - 1
    ):
        raise ValueError(
            f"reduce_final_map: found {tuple(reduce_final_map.shape)}, expected "
            f"[{reduce_indptr.numel() - 1}, 2] (q_start, q_end per tile of reduce_indptr)"
        )
    if final_lse is not None and tuple(final_lse.shape) != tuple(out.shape[:2]):
        raise ValueError(f"final_lse: found {tuple(final_lse.shape)}, expected {tuple(out.shape[:2])}")
    check_writable_layout("out", out)
    if final_lse is not None:
        check_writable_layout("final_lse", final_lse)
    if reduce_final_map is not None and reduce_final_map.shape[0] > reduce_indptr.numel() - 1:
        reduce_final_map = reduce_final_map[: reduce_indptr.numel() - 1]
    if validate if validate is not None else out.device.type == "cpu":
        check_reduce_maps(
            reduce_indptr.cpu(),
            None if reduce_final_map is None else reduce_final_map.cpu(),
            reduce_partial_map.cpu(),
            tile_q=tile_q, partial_rows=partial_out.shape[0], total_q=out.shape[0],
        )
    inputs = ReduceInputs(
        partial_out=partial_out.contiguous(),
        partial_lse=partial_lse.contiguous(),
        reduce_indptr=reduce_indptr,
        reduce_final_map=reduce_final_map,
        reduce_partial_map=reduce_partial_map,
        tile_q=tile_q,
        num_kv_splits=num_kv_splits,
        out=out,
        final_lse=final_lse,
    )
    get_registry().select(inputs, kernel).reduce(inputs)


def available_kernels(device: torch.device | str | None = None) -> list[KernelInfo]:
    """Every registered kernel, whether it can run on `device` (default: cuda if present) and why not."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return get_registry().infos(check_device("device", device))


def lse_heads_first(plan: PrefillPlan) -> bool:
    """Whether `mla_prefill(..., plan=plan, return_lse=True)` without `lse=` hands back an lse
    [total_q, H] whose memory is heads-first (`lse.t()`, [H, total_q], contiguous: the
    flash_attn provider returns FA3's own tensor). A caller that needs [H, total_q] (vLLM)
    then takes `lse.t()` and copies nothing; where this is False it passes
    `lse=torch.empty(H, total_q).t()` and the kernel writes that buffer in place, again with
    no copy. For the kernel that runs the plan (the plan's own: `plan.kernel`)."""
    if not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan: found {type(plan).__name__}, expected a PrefillPlan from plan_prefill")
    return _plans_kernel(plan).lse_heads_first


def unsupported_reasons(
    *,
    num_heads: int,
    qk_head_dim: int,
    v_head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    fp8: bool,
    kernel: str = "auto",
) -> list[str]:
    """[] when some kernel (or the named one) can run this configuration, else every reason.

    `kernel="auto"` follows MLA_PLUGINS_KERNEL when it pins a kernel, as `mla_prefill` does.
    Arguments of the wrong type or out of range raise TypeError/ValueError naming them.
    """
    check_positive_int("num_heads", num_heads, maximum=MAX_NUM_HEADS)
    check_positive_int("qk_head_dim", qk_head_dim)
    check_positive_int("v_head_dim", v_head_dim)
    check_dtype("dtype", dtype)
    torch_device = check_device("device", device)
    check_bool("fp8", fp8)
    if not isinstance(kernel, str):
        raise TypeError(f"kernel: found {type(kernel).__name__}, expected a kernel name (str)")
    inputs = ConfigInputs(num_heads, qk_head_dim, v_head_dim, dtype, torch_device, fp8)
    registry = get_registry()
    source = "kernel"
    if kernel == "auto" and pinned_kernel() is not None:
        kernel, source = pinned_kernel(), "MLA_PLUGINS_KERNEL"
    if kernel != "auto":
        chosen = registry.get(kernel, source=source)
        return [f"{kernel}: {r}" for r in registry.reasons(chosen, inputs)]
    rejections = registry.rejections(inputs)
    if any(not r for r in rejections.values()):
        return []
    return [f"{name}: {r}" for name, reasons in rejections.items() for r in reasons]
