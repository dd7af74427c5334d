"""Argument checks shared by the public API. Every message names the argument, what was
found and what was expected, so a framework user can act on it without reading our code."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16)
INT32_MAX = 2**31 - 1

#: Bounds of the planner's knobs. The plan is built on the host in Python, one list per
#: worker, so a worker count far beyond any GPU (the largest have a few hundred CUs/SMs)
#: would spend minutes and gigabytes before failing; tiles and key units address rows with
#: int32, as AITER's metadata does.
MAX_NUM_WORKERS = 1 << 16
MAX_TILE_Q = 1 << 20
MAX_KV_GRANULARITY = 1 << 20
MAX_NUM_HEADS = (1 << 15) - 1  # head ranges pack two 16-bit head indices into one int32
PLAN_MAXIMA = {"tile_q": MAX_TILE_Q, "kv_granularity": MAX_KV_GRANULARITY, "num_workers": MAX_NUM_WORKERS}
#: Query tiles one plan may hold: a bound on the planner's host work, not an int32 limit.
#: The planner walks every tile in Python (about 6 us each on one CPU core, and a work item
#: of 8 int32 per tile and cluster), so 2**31 - 1 query tokens (8.4M tiles of 256 rows)
#: would spend minutes and gigabytes before failing or running. 2**19 tiles (134M query rows
#: at tile_q=256, 34M at 64; about 5 s and 400 MB to plan) lie far past any batch a GPU
#: holds: at 16 heads of 192 bf16 values their q alone is 825 GB (at 256) or 206 GB (at 64).
#: The plan's int32 fields (offsets, partial rows, work items) do not overflow before that.
MAX_PLAN_TILES = 1 << 19


def check_positive_int(name: str, value, *, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: found {type(value).__name__} {value!r}, expected a positive int")
    if value < 1:
        raise ValueError(f"{name}: found {value}, expected a positive int")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: found {value}, expected a positive int <= {maximum}")


def check_nonnegative_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: found {type(value).__name__} {value!r}, expected an int >= 0")
    if value < 0:
        raise ValueError(f"{name}: found {value}, expected an int >= 0 (0 = kernel default)")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: found {type(value).__name__} {value!r}, expected bool (True or False)")


def check_dtype(name: str, value) -> None:
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"{name}: found {type(value).__name__} {value!r}, expected a torch.dtype such as "
            "torch.bfloat16"
        )


def check_device(name: str, value) -> torch.device:
    """A torch.device from a device, a device string ('cpu', 'cuda:0') or a GPU index."""
    if isinstance(value, torch.device):
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(
            f"{name}: found {type(value).__name__} {value!r}, expected a torch.device, a device "
            "string such as 'cuda:0' or 'cpu', or a GPU index"
        )
    try:
        return torch.device(value)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(
            f"{name}: found {value!r}, expected a device string such as 'cuda', 'cuda:0' or "
            f"'cpu' (torch says: {str(exc).splitlines()[0]})"
        ) from None


def check_not_meta(name: str, t) -> None:
    if isinstance(t, torch.Tensor) and t.device.type == "meta":
        raise ValueError(
            f"{name}: found a tensor on the meta device (shape only, no data), expected a tensor "
            "with data on the CPU or a GPU"
        )


def check_tensor(name: str, t, *, ndim: int, dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: found {type(t).__name__}, expected a torch.Tensor")
    if t.dim() != ndim:
        raise ValueError(f"{name}: found shape {tuple(t.shape)} ({t.dim()}-D), expected {ndim}-D")
    if dtypes is not None and t.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: found dtype {t.dtype}, expected {expected}")


def check_same_device(reference_name: str, reference: torch.Tensor, **others) -> None:
    """Tensors among `others` must live where `reference` does (non-tensors are not checked
    here: host offsets as lists are checked by `check_cu_seqlens`)."""
    for name, t in others.items():
        if isinstance(t, torch.Tensor) and t.device != reference.device:
            raise ValueError(
                f"{name}: found device {t.device}, expected {reference.device} "
                f"(the device of {reference_name}); move it with .to({str(reference.device)!r})"
            )


def check_writable_layout(name: str, t: torch.Tensor, *, unit_last: bool = True) -> None:
    """An output must own its elements: an expanded view (stride 0 over a dim of size > 1)
    aliases many elements to one address; and, with `unit_last`, a unit stride in the last
    dim is required."""
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride(), strict=True)):
        if size > 1 and stride == 0:
            raise ValueError(
                f"{name}: found stride 0 in dim {dim} (an expanded view: its elements share "
                f"memory), expected a tensor that owns each element, e.g. torch.empty{tuple(t.shape)}"
            )
    if unit_last and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: found strides {t.stride()}, expected a unit stride in the last dim")


def check_dims_positive(name: str, t: torch.Tensor, dims: dict[int, str]) -> None:
    """The named dims of `t` are at least 1 (e.g. {1: 'heads', 2: 'head dim'})."""
    for dim, what in dims.items():
        if t.shape[dim] < 1:
            raise ValueError(
                f"{name}: found {what} 0 (shape {tuple(t.shape)}), expected at least 1"
            )


def _is_numpy(value) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "tolist") and hasattr(value, "dtype")


def _host_offsets(name: str, value) -> list[int]:
    """Offsets as a host list: from an int32 tensor (one device read), a list/tuple of ints
    or a 1-D integer numpy array."""
    if isinstance(value, torch.Tensor):
        check_tensor(name, value, ndim=1, dtypes=(torch.int32,))
        check_not_meta(name, value)
        host = value.tolist()
    elif _is_numpy(value):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise TypeError(
                f"{name}: found a numpy array of dtype {value.dtype} and shape {value.shape}, "
                "expected 1-D integer offsets"
            )
        host = [int(x) for x in value.tolist()]
    elif isinstance(value, (list, tuple)):
        host = list(value)
        for i, x in enumerate(host):
            if isinstance(x, bool) or not isinstance(x, int):
                if hasattr(x, "__index__") and not isinstance(x, bool):
                    host[i] = x.__index__()  # numpy integer scalars
                    continue
                raise TypeError(
                    f"{name}: found {type(x).__name__} {x!r} at index {i}, expected int offsets"
                )
    else:
        raise TypeError(
            f"{name}: found {type(value).__name__}, expected an int32 torch.Tensor or a "
            "list/tuple of int offsets [batch + 1]"
        )
    if len(host) < 1:
        raise ValueError(f"{name}: found no offsets, expected [batch + 1] offsets from 0")
    return host


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k) -> tuple[list[int], list[int]]:
    """Both [B+1], same length (and device, for tensors), starting at 0, non-decreasing, < 2**31.

    Each may be an int32 tensor (one device read each), a list/tuple of ints or a 1-D
    integer numpy array. Returns their host copies, so callers need not read them again.
    """
    hosts = [_host_offsets("cu_seqlens_q", cu_seqlens_q), _host_offsets("cu_seqlens_k", cu_seqlens_k)]
    if len(hosts[0]) != len(hosts[1]):
        raise ValueError(
            f"cu_seqlens_k: found shape ({len(hosts[1])},), expected ({len(hosts[0])},) like "
            "cu_seqlens_q (one offset per sequence + 1)"
        )
    if isinstance(cu_seqlens_q, torch.Tensor) and isinstance(cu_seqlens_k, torch.Tensor):
        check_same_device("cu_seqlens_q", cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    for name, host in zip(("cu_seqlens_q", "cu_seqlens_k"), hosts, strict=True):
        if host[0] != 0:
            raise ValueError(f"{name}: found first offset {host[0]}, expected 0")
        for i in range(1, len(host)):
            if host[i] < host[i - 1]:
                raise ValueError(
                    f"{name}: found decreasing offsets {host[i - 1]} -> {host[i]} at index {i}, "
                    "expected non-decreasing cumulative sequence lengths"
                )
        if host[-1] > INT32_MAX:
            raise ValueError(f"{name}: found total {host[-1]}, expected at most {INT32_MAX} (int32)")
    return hosts[0], hosts[1]


def offsets_tensor(name: str, value, host: list[int], device: torch.device) -> torch.Tensor:
    """`value` as an int32 tensor on `device`: itself when it already is one, else a copy of
    `host` (its checked host values)."""
    if isinstance(value, torch.Tensor) and value.device == device:
        return value
    return torch.tensor(host, dtype=torch.int32, device=device)


def check_plan_param(name: str, value) -> None:
    """tile_q, kv_granularity or num_workers: a positive int within PLAN_MAXIMA."""
    check_positive_int(name, value, maximum=PLAN_MAXIMA[name])


def check_plan_tiles(cu_seqlens_q: list[int], tile_q: int) -> int:
    """The query tiles of a plan (host offsets, checked), at most MAX_PLAN_TILES: counted
    per sequence in O(batch) before the planner walks them."""
    tiles = sum(-(-(b - a) // tile_q) for a, b in zip(cu_seqlens_q, cu_seqlens_q[1:], strict=False))
    if tiles > MAX_PLAN_TILES:
        raise ValueError(
            f"cu_seqlens_q: found {cu_seqlens_q[-1]} query tokens in {len(cu_seqlens_q) - 1} "
            f"sequences, {tiles} tiles of tile_q={tile_q} rows, expected at most "
            f"{MAX_PLAN_TILES} tiles per plan (MAX_PLAN_TILES: the host planner walks every "
            "tile); plan the batch in parts, or pass a larger tile_q"
        )
    return tiles


def check_partial_rows(num_pieces: int, tile_q: int) -> None:
    """The partial buffers' rows (`num_pieces * tile_q`) must be addressable in int32."""
    if num_pieces * tile_q > INT32_MAX:
        raise ValueError(
            f"tile_q: found {tile_q}, which with {num_pieces} split pieces needs "
            f"{num_pieces * tile_q} partial rows, expected at most {INT32_MAX} (int32 row "
            "offsets); use a smaller tile_q"
        )


def check_reduce_maps(
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor | None,
    reduce_partial_map: torch.Tensor,
    *,
    tile_q: int,
    partial_rows: int,
    total_q: int,
) -> None:
    """Index values of the reduce maps (host tensors; callers copy device maps first).

    Only tiles with two or more pieces are read by a reduce (AITER skips the others, and
    padding at the end of reduce_indptr repeats its last value), so only theirs are checked.
    """
    indptr = reduce_indptr.long()
    pmap = reduce_partial_map.long()
    if (indptr < 0).any():
        i = int((indptr < 0).nonzero()[0])
        raise ValueError(f"reduce_indptr: found {int(indptr[i])} at index {i}, expected offsets >= 0")
    steps = indptr[1:] - indptr[:-1]
    if (steps < 0).any():
        i = int((steps < 0).nonzero()[0]) + 1
        raise ValueError(
            f"reduce_indptr: found decreasing offsets {int(indptr[i - 1])} -> {int(indptr[i])} at "
            f"index {i}, expected a non-decreasing CSR over reduce_partial_map"
        )
    if int(indptr[-1]) > pmap.numel():
        raise ValueError(
            f"reduce_indptr: found last offset {int(indptr[-1])}, expected at most "
            f"{pmap.numel()} (the length of reduce_partial_map)"
        )
    used = (steps >= 2).nonzero().flatten()
    if used.numel() == 0:
        return
    starts, ends = indptr[:-1][used], indptr[1:][used]
    if reduce_final_map is not None:
        fmap = reduce_final_map.long()[used]
        q0, q1 = fmap[:, 0], fmap[:, 1]
        bad = (q0 < 0) | (q1 < q0) | (q1 > total_q) | (q1 - q0 > tile_q)
        if bad.any():
            j = int(bad.nonzero()[0])
            t = int(used[j])
            raise ValueError(
                f"reduce_final_map: found rows ({int(q0[j])}, {int(q1[j])}) for tile {t}, expected "
                f"0 <= q_start <= q_end <= {total_q} (rows of out) and at most tile_q={tile_q} rows"
            )
        rows = q1 - q0
    else:
        # AITER's rule without a final map: rows = the distance of the first two pieces,
        # tile t covers rows [t * rows, (t + 1) * rows)
        rows = pmap[starts + 1] - pmap[starts]
        q0 = used * rows
        bad = (rows < 0) | (rows > tile_q) | (q0 + rows > total_q)
        if bad.any():
            j = int(bad.nonzero()[0])
            t = int(used[j])
            raise ValueError(
                f"reduce_partial_map: found tile {t} of {int(rows[j])} rows at output row "
                f"{int(q0[j])} (without reduce_final_map rows are the distance of a tile's first "
                f"two pieces), expected 0..{tile_q} rows (tile_q) inside out's {total_q} rows; "
                "pass reduce_final_map"
            )
    counts = ends - starts
    piece = torch.repeat_interleave(torch.arange(used.numel()), counts)
    offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts
    )
    index = starts[piece] + offsets
    base = pmap[index]
    bad = (base < 0) | (base + rows[piece] > partial_rows)
    if bad.any():
        j = int(bad.nonzero()[0])
        raise ValueError(
            f"reduce_partial_map: found base row {int(base[j])} at index {int(index[j])} for a "
            f"piece of {int(rows[piece][j])} rows, expected 0 <= base and base + rows <= "
            f"{partial_rows} (rows of partial_out / partial_lse)"
        )
