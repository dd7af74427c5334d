"""The fake's stand-ins for AITER's C++/HIP/asm code, written from AITER's source.

- `get_ps_metadata_v1`: csrc/kernels/mla/metadata/v1_2_host.cuh (identical at v0.1.15 and
  v0.1.16; v0.1.20.post1 only swaps torch::Tensor for aiter_tensor_t and copies with
  hipMemcpy), line numbers below are v0.1.16's.
- `mla_reduce_v1`: csrc/kernels/mla/reduce.cu (v0.1.16; v0.1.20.post1 is the same math
  and adds 48 and 96 heads at Dv 128 to the router).
- `mla_prefill_ps_asm_fwd`: the asm kernel is closed (hsa/gfx950/mla/*.co); its checks come
  from csrc/py_itfs_cu/asm_mla.cu, its result from what AITER's op test demands
  (op_tests/test_mla_prefill_ps.py::ref_masked_attention, bottom-right causal), computed per
  work item in float32. Values the real kernel writes where no key is visible are not
  readable in any source: modelled as out 0 and lse -inf (what the reduce's +inf branch,
  reduce.cu:275/658, implies for its inputs); `EMPTY_ROW_OUT` can poison them in tests.
"""

from __future__ import annotations

import math

import torch

from . import _fake_config as _cfg

#: every mla_reduce_v1 call that reached the kernel: {"op", "nargs", "num_kv_splits", ...};
#: nargs counts what torch passed on (it leaves out a trailing final_lse=None)
calls: list[dict] = []
#: every op call that reached a kernel, in order: {"op", ...}
all_calls: list[dict] = []
#: what the fake asm writes to `output` for rows of an unsplit item that see no key
EMPTY_ROW_OUT = 0.0

FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _ceil_div_c(x: int, y: int) -> int:
    """v1_comm.cuh:17 integer_divide_ceil, `(x + y - 1) / y` with C's truncating division."""
    n = x + y - 1
    return n // y if n >= 0 else -((-n) // y)


def _generate_reduce_info(works, n_indptr, n_final, n_partial):
    """v1_2_host.cuh:20-59: group pieces by (qo_start, qo_end) in a std::map (sorted), each
    group's partial locations in a std::set (sorted, deduplicated across heads)."""
    groups: dict[tuple[int, int], set[int]] = {}
    for w in works:
        if w[1] == -1:
            continue
        groups.setdefault((w[2], w[3]), set()).add(w[1])
    indptr = [0] * n_indptr
    final = [[0, 0] for _ in range(n_final)]
    partial = [0] * n_partial
    final_idx = partial_idx = 0
    for key in sorted(groups):
        locs = sorted(groups[key])
        if final_idx + 1 >= n_indptr or final_idx >= n_final or partial_idx + len(locs) > n_partial:
            raise RuntimeError(
                "get_ps_metadata_v1 (fake): the reduce buffers are too small for this plan "
                f"({len(groups)} groups, reduce_indptr holds {n_indptr}, reduce_partial_map "
                f"{n_partial}); the real planner writes past them"
            )
        indptr[final_idx + 1] = indptr[final_idx] + len(locs)
        final[final_idx] = [key[0], key[1]]
        partial[partial_idx : partial_idx + len(locs)] = locs
        final_idx += 1
        partial_idx += len(locs)
    for i in range(final_idx, n_indptr):  # :55-58, the tail padded with the final count
        indptr[i] = partial_idx
    return indptr, final, partial


def _generate_ps_metadata(qo, kv, ctx, num_heads_k, qhead_gran, qlen_gran, kvlen_gran, block_size,
                          is_causal, need_lse, work_indptr, works, available_tgs, cluster_id,
                          current_work_idx):
    """v1_2_host.cuh:61-241 kn_generate_ps_metadata, one cluster."""
    batch_size = len(qo) - 1
    assert kvlen_gran % block_size == 0
    blocks_per_unit = kvlen_gran // block_size
    # Step 1 (:82-124): query tiles in ping-pong order, units of kvlen_granularity
    tiles = []  # (batch, qo_start, qo_end, num_blocks, effective_kv_length)
    total_units = 0
    for b in range(batch_size):
        qo_len, kv_len = qo[b + 1] - qo[b], ctx[b]
        ranges = [(s, min(s + qlen_gran, qo_len)) for s in range(0, qo_len, qlen_gran)]
        n = len(ranges)
        for i in range(n):
            idx = i // 2 if i % 2 == 0 else n - 1 - i // 2
            lo, hi = ranges[idx]
            eff = min(kv_len - qo_len + hi, kv_len) if is_causal else kv_len
            units = _ceil_div_c(eff, kvlen_gran)
            tiles.append((b, lo + qo[b], hi + qo[b], units * blocks_per_unit, eff))
            total_units += units
    average = int(total_units / available_tgs)  # C++ truncation (:125-126)
    reminder = total_units - average * available_tgs
    # Step 2 (:145-240): every TG walks the tiles once per KV head of its cluster
    tile_idx = block_idx = partial_tile_idx = 0
    for tg in range(available_tgs):
        for k_head_offset in range(num_heads_k):
            k_head_idx = cluster_id * num_heads_k + k_head_offset
            lo_h, hi_h = k_head_idx * qhead_gran, (k_head_idx + 1) * qhead_gran
            qhead_range = (hi_h << 16) | (lo_h & 0xFFFF)  # ps.h:10 pack_dword
            saved = (tile_idx, block_idx, partial_tile_idx)
            capacity = (average + 1) * blocks_per_unit if tg < reminder else average * blocks_per_unit
            while tile_idx < len(tiles) and capacity > 0:
                b, q0, q1, num_blocks, eff = tiles[tile_idx]
                remaining_blocks = num_blocks - block_idx
                remaining_kv_len = eff - block_idx * block_size
                kv_start = block_idx + kv[b]
                if remaining_kv_len <= capacity * block_size:  # :177, the tile finishes here
                    consuming = remaining_blocks
                    if block_idx == 0 and not need_lse:
                        loc = -1
                    else:
                        loc = qlen_gran * partial_tile_idx
                        partial_tile_idx += 1
                    kv_end = min(kv_start + consuming, kv[b + 1])  # rounded up, clamped (:186)
                    works.append([b, loc, q0, q1, kv_start, kv_end, 0, qhead_range])
                    tile_idx += 1
                    block_idx = 0
                else:  # :201-225, a piece: kv_offset = tokens left after it
                    consuming = capacity
                    loc = qlen_gran * partial_tile_idx
                    partial_tile_idx += 1
                    kv_end = min(kv_start + consuming, kv[b + 1])
                    kv_offset = ctx[b] - (kv_end - kv[b]) * block_size
                    works.append([b, loc, q0, q1, kv_start, kv_end, kv_offset, qhead_range])
                    block_idx += consuming
                capacity -= consuming
            if k_head_offset != num_heads_k - 1:  # :232-237, the next head repeats the walk
                tile_idx, block_idx, partial_tile_idx = saved
        work_indptr[cluster_id * available_tgs + tg + 1] = len(works)


def get_ps_metadata_v1(seqlens_qo_indptr, pages_kv_indptr, context_lens, gqa_ratio, num_heads_k,
                       work_metadata_ptrs, work_indptr, work_info, reduce_indptr, reduce_final_map,
                       reduce_partial_map, qhead_granularity=1, qlen_granularity=256,
                       kvlen_granularity=16, block_size=16, is_causal=True, need_lse=False):
    """v1_2_host.cuh:243-358 get_ps_metadata_v1_2_host."""
    record = {"op": "get_ps_metadata_v1", "need_lse": bool(need_lse), "is_causal": bool(is_causal)}
    all_calls.append(record)
    available_tgs = _cfg.CU_COUNT
    batch_size = seqlens_qo_indptr.size(0) - 1
    num_clusters = math.gcd(num_heads_k, available_tgs)
    tgs_per_cluster = available_tgs // num_clusters
    kheads_per_cluster = num_heads_k // num_clusters
    qo = seqlens_qo_indptr.cpu().int().tolist()[: batch_size + 1]
    kv = pages_kv_indptr.cpu().int().tolist()[: batch_size + 1]
    ctx = context_lens.cpu().int().tolist()[:batch_size]
    indptr_vec = [0] * work_indptr.numel()
    works: list[list[int]] = []
    for cluster_id in range(num_clusters):
        _generate_ps_metadata(qo, kv, ctx, kheads_per_cluster, qhead_granularity, qlen_granularity,
                              kvlen_granularity, block_size, is_causal, bool(need_lse), indptr_vec,
                              works, tgs_per_cluster, cluster_id, indptr_vec[cluster_id * tgs_per_cluster])
    max_works = work_info.numel() // 8
    if len(works) > max_works:
        raise RuntimeError(f"get_ps_metadata_v1 (fake): {len(works)} work items, work_info holds "
                           f"{max_works}; the real planner writes past the buffer")
    r_indptr, r_final, r_partial = _generate_reduce_info(
        works, reduce_indptr.numel(), reduce_final_map.numel() // 2, reduce_partial_map.numel())
    record.update(items=len(works), partial_tiles=r_indptr[-1], max_partials=reduce_partial_map.numel())
    # H2D of the whole buffers (:325-351): tails are the host vectors' zeros
    info = torch.zeros(max_works, 8, dtype=torch.int32)
    if works:
        info[: len(works)] = torch.tensor(works, dtype=torch.int32)
    work_indptr.copy_(torch.tensor(indptr_vec, dtype=torch.int32))
    work_info.copy_(info.view(work_info.shape))
    reduce_indptr.copy_(torch.tensor(r_indptr, dtype=torch.int32))
    reduce_final_map.copy_(torch.tensor(r_final, dtype=torch.int32).view(reduce_final_map.shape))
    reduce_partial_map.copy_(torch.tensor(r_partial, dtype=torch.int32))


def mla_prefill_ps_asm_fwd(Q, K, V, qo_indptr, kv_indptr, kv_page_indices, work_indptr,
                           work_info_set, max_seqlen_q, softmax_scale, is_causal, splitData,
                           splitLse, output, q_scale=None, k_scale=None, v_scale=None):
    """Phase 1 over AITER's work items (checks from csrc/py_itfs_cu/asm_mla.cu:475-600)."""
    all_calls.append({"op": "mla_prefill_ps_asm_fwd", "heads": Q.size(1), "split_rows": splitData.size(0)})
    name = "mla_prefill_ps_asm_fwd"
    if Q.dtype not in FP8:
        raise RuntimeError(f"{name}: unsupport Q dtype:{Q.dtype}")
    if K.dtype not in FP8:
        raise RuntimeError(f"{name}: unsupport K dtype:{K.dtype}")
    gqa = Q.size(1) // K.size(1)
    # hsa/gfx950/mla/mla_asm.csv: the only ps prefill rows are qh192_vh128, Gqa 1, bf16 out
    if gqa != 1 or Q.size(2) != 192 or V.size(2) != 128 or output.dtype != torch.bfloat16:
        raise RuntimeError(f"{name}: cannot find suitable kernel")
    if Q.size(1) % 8 and Q.size(1) != 1:  # AITER's op test runs 1 and 16 heads
        # not in AITER's source: SGLang PR #23927 saw out-of-bounds reads with 10 heads on the
        # m32x8 kernel; the fake refuses instead of reading past the buffers
        raise RuntimeError(f"{name} (fake): {Q.size(1)} heads; the m32x8 kernel reads out of bounds "
                           "unless the head count is a multiple of 8")
    scale = lambda s: 1.0 if s is None else s.float()  # noqa: E731
    q = Q.float() * scale(q_scale)
    k = K.float() * scale(k_scale)
    v = V.float() * scale(v_scale)
    pages = kv_page_indices.cpu().long()
    qo = qo_indptr.cpu().tolist()
    kvp = kv_indptr.cpu().tolist()
    wp = work_indptr.cpu().tolist()
    items = work_info_set.cpu().tolist()
    grid = work_indptr.size(0) - 1  # asm_mla.cu: one workgroup per CU
    # items that differ only in their heads run together
    jobs: dict[tuple, list[int]] = {}
    for w in range(grid):
        for item in items[wp[w] : wp[w + 1]]:
            b, loc, q0, q1, k0, k1, kv_offset, head_range = item
            lo, hi = head_range & 0xFFFF, (head_range >> 16) & 0xFFFF
            jobs.setdefault((b, loc, q0, q1, k0, k1, kv_offset), []).extend(range(lo, hi))
    for (b, loc, q0, q1, k0, k1, kv_offset), heads in jobs.items():
        q_len, k_len = qo[b + 1] - qo[b], kvp[b + 1] - kvp[b]
        if loc != -1 and kv_offset and kv_offset != k_len - (k1 - kvp[b]):
            raise RuntimeError(f"{name} (fake): work item {[b, loc, q0, q1, k0, k1, kv_offset]}: "
                               f"kv_offset is not the {k_len - (k1 - kvp[b])} tokens left after "
                               "the piece, as AITER's planner writes it")
        h = torch.tensor(heads, dtype=torch.long)
        rows = q1 - q0
        if rows <= 0:
            continue
        qs = q[q0:q1][:, h].transpose(0, 1)  # [h, r, d]
        ks = k[pages[k0:k1]][:, h].transpose(0, 1) if k1 > k0 else k.new_zeros(len(heads), 0, k.size(2))
        vs = v[pages[k0:k1]][:, h].transpose(0, 1) if k1 > k0 else v.new_zeros(len(heads), 0, v.size(2))
        s = torch.matmul(qs, ks.transpose(1, 2)) * float(softmax_scale)
        if is_causal and k1 > k0:
            r_local = torch.arange(q0, q1)[:, None] - qo[b]
            j_local = torch.arange(k0, k1)[None, :] - kvp[b]
            s = s.masked_fill(j_local > r_local + (k_len - q_len), float("-inf"))
        m = s.amax(-1, keepdim=True) if s.size(-1) else s.new_full((*s.shape[:2], 1), float("-inf"))
        seen = torch.isfinite(m)
        p = torch.exp(s - torch.where(seen, m, 0.0))
        denom = p.sum(-1, keepdim=True)
        o = torch.matmul(p, vs) / torch.where(seen, denom, 1.0)
        lse = torch.where(seen, m + torch.log(torch.where(seen, denom, 1.0)), float("-inf"))[..., 0]
        o = o.transpose(0, 1)  # [r, h, dv]
        lse = lse.transpose(0, 1)  # [r, h]
        seen_rows = seen[..., 0].transpose(0, 1)
        if loc == -1:
            o = torch.where(seen_rows[..., None], o, EMPTY_ROW_OUT)
            output[q0:q1, h] = o.to(output.dtype)
        else:
            o = torch.where(seen_rows[..., None], o, 0.0)
            splitData[loc : loc + rows, h] = o
            splitLse[loc : loc + rows, h] = lse


def _router_heads(dv):
    return _cfg.ROUTER.get(dv, ())


def mla_reduce_v1(partial_output, partial_lse, reduce_indptr, reduce_final_map, reduce_partial_map,
                  max_seqlen_q, *rest):
    """reduce.cu:1024-1080 (host) and the kernels it launches (:417-760)."""
    names = {"legacy": ("final_output", "final_lse"),
             "num_kv_splits": ("num_kv_splits", "final_output", "final_lse"),
             "unknown": ("final_output", "final_lse", "num_kv_splits")}[_cfg.REDUCE_CONVENTION]
    values = dict(zip(names, rest, strict=False))
    final_output, final_lse = values["final_output"], values.get("final_lse")
    record = {"op": "mla_reduce_v1", "nargs": 6 + len(rest), "num_kv_splits": values.get("num_kv_splits"),
              "partial_rows": partial_output.size(0), "partial_tiles": int(reduce_indptr[-1]),
              "final_lse": final_lse is not None}
    calls.append(record)
    all_calls.append(record)
    if partial_output.dtype != torch.float32 or partial_lse.dtype != torch.float32:
        raise RuntimeError("mla_reduce_v1: partial_out and partial_lse must be float32!")
    num_reduce_tile = reduce_indptr.size(0) - 1
    num_heads = partial_output.size(-2)
    head_dim = final_output.size(-1)
    if num_reduce_tile <= 0:
        return
    if num_heads not in _router_heads(head_dim):
        raise RuntimeError("kn_mla_reduce_v1 doesn't support the specified settings: "
                           f"#heads: {num_heads}, head dimension: {head_dim}.")
    if final_output.dtype not in (torch.bfloat16, torch.float16):
        raise RuntimeError(f"kn_mla_reduce_v1 doesn't support output type {final_output.dtype}.")
    ind = reduce_indptr.cpu().tolist()
    pmap = reduce_partial_map.cpu().tolist()
    fmap = reduce_final_map.cpu().tolist() if reduce_final_map is not None else None
    last = ind[num_reduce_tile]
    po = partial_output.reshape(-1, num_heads, partial_output.size(-1))
    pl = partial_lse.reshape(-1, num_heads)
    for t in range(num_reduce_tile):
        s0, s1 = ind[t], ind[t + 1]
        if s0 == last:  # the persistent kernel stops here (:692); padding tiles are empty
            break
        n = s1 - s0
        # :743 only groups of two or more pieces reach a kernel; with #3606 (need_lse) a
        # single piece is merged too (modelled: the simple path over one piece)
        if n < 2 and not (n == 1 and _cfg.NEED_LSE):
            continue
        if fmap is not None:
            q0, q1 = fmap[t]
        else:
            qo_len = pmap[s0 + 1] - pmap[s0] if s0 + 1 < len(pmap) else 0
            q0, q1 = t * qo_len, (t + 1) * qo_len
        rows = q1 - q0
        if rows <= 0:
            continue
        lse = torch.stack([pl[b : b + rows] for b in pmap[s0:s1]])  # [n, rows, H]
        out = torch.stack([po[b : b + rows] for b in pmap[s0:s1]])  # [n, rows, H, Dv]
        if n >= 4:  # massive path, reduce_lse_massive (:194-300) + reduce_output_massive
            max_lse = lse.amax(0)
            sum_lse = torch.exp(lse - max_lse).sum(0)
            bad = (sum_lse == 0) | torch.isnan(sum_lse)
            global_lse = torch.where(bad, float("inf"), torch.log(sum_lse) + max_lse)
            merged = (torch.exp(lse - global_lse)[..., None] * out).sum(0)
        else:  # simple path, mla_reduce_v1_impl_simple (:539-667): a running max
            max_lse, sum_e, acc = lse[0], torch.ones_like(lse[0]), out[0]
            for j in range(1, n):
                new_max = torch.maximum(max_lse, lse[j])
                old_scale = torch.exp(max_lse - new_max)
                new_scale = torch.exp(lse[j] - new_max)
                acc = old_scale[..., None] * acc + new_scale[..., None] * out[j]
                max_lse, sum_e = new_max, sum_e * old_scale + new_scale
            merged = acc / sum_e[..., None]
            bad = (sum_e == 0) | torch.isnan(sum_e)
            global_lse = torch.where(bad, float("inf"), torch.log(sum_e) + max_lse)
        final_output[q0:q1] = merged.to(final_output.dtype)
        if final_lse is not None:
            final_lse[q0:q1] = global_lse.to(final_lse.dtype)
