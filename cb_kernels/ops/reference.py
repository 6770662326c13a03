"""Pure-torch references of every op: slow, obviously right, and the tests' oracle."""


def ref_write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Scatter each token's K/V into its cache slot; slot -1 skips the token.

    key, value: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim] (written in place); slot_mapping: int64 [num_tokens], slot =
    block_id * block_size + offset.
    """
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep]
    v_cache[blocks, offsets] = value[keep]


def ref_copy_blocks(k_caches, v_caches, block_mapping) -> None:
    """Copy block src to block dst in every layer's K and V cache, for each (src, dst) pair.

    k_caches, v_caches: lists over layers of [num_blocks, ...]; block_mapping: int64 [n, 2].
    """
    ref_swap_blocks(list(k_caches) + list(v_caches), list(k_caches) + list(v_caches), block_mapping)


def ref_swap_blocks(src_caches, dst_caches, block_mapping) -> None:
    """dst_caches[i][dst] = src_caches[i][src] for each (src, dst) pair and every i.

    src_caches, dst_caches: equal-length lists of [num_blocks, ...] (block counts may differ);
    block_mapping: int64 [n, 2]. Copies go one block at a time so no pair reads another's output
    through a temporary, whatever device each side is on.
    """
    for src, dst in block_mapping.tolist():
        for s, d in zip(src_caches, dst_caches):
            d[dst].copy_(s[src])
