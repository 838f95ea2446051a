"""The paged KV cache without a model: the block pool, its prefix cache, and the scheduling of sequences.

Run: .venv/bin/pytest tests/test_llm_blocks.py -q

`BlockPool`: allocation order (blocks without a name first, then the least recently freed), shared
blocks and reference counts, names found until their block is reused, `reset()` forgetting them.
`PagedSequences`: chunked prefill under the token budget with decodes first, waiting while blocks
run out, preemption of the newest sequence (which resumes with its whole history), the prefix
cache reused across sequences (and in the same iteration), and the same decisions from the same
calls (what keeps tensor-parallel ranks in step). `RaggedBatch` attention equals a dense causal
attention of each sequence.
"""

from __future__ import annotations

import pytest
import torch

from phyai_ray.llm.blocks import BlockPool, BlocksExhaustedError, chain_hash
from phyai_ray.llm.paged import Chunk, PagedSequences
from phyai_ray.llm.ragged import RaggedBatch


def pool(num_blocks: int = 8, block_size: int = 4, caching: bool = True) -> BlockPool:
    return BlockPool(num_blocks=num_blocks, block_size=block_size, layers=1, kv_heads=1, head_dim=2,
                     to={"dtype": torch.float32}, prefix_caching=caching)


def payload(prompt: list[int], max_tokens: int = 4) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0,
            "stop_token_ids": []}


def step(paged: PagedSequences, token: int = 7) -> list[tuple[int, int]]:
    """One iteration without a model: every sampling chunk draws `token`; returns (seq_id, n) per chunk."""
    chunks = paged.schedule()
    sampled = sum(c.samples for c in chunks)
    paged.finish(chunks, [token] * sampled, [0.0] * sampled)
    return [(c.seq.seq_id, c.n) for c in chunks]


def test_pool_allocates_unnamed_blocks_first_then_the_least_recently_freed() -> None:
    p = pool(num_blocks=4)
    a, b, c = p.allocate(), p.allocate(), p.allocate()
    assert (a, b, c) == (0, 1, 2) and p.free_count == 1
    p.register(a, chain_hash(None, [1, 2, 3, 4]))
    p.free([a])
    p.free([b])  # unnamed: reused before the named block a
    assert p.allocate() == b and p.allocate() == 3
    assert p.lookup(chain_hash(None, [1, 2, 3, 4])) == a  # still findable while free
    assert p.allocate() == a  # the last free block: now its name is gone
    assert p.lookup(chain_hash(None, [1, 2, 3, 4])) is None
    with pytest.raises(BlocksExhaustedError, match="no free KV block of 4"):
        p.allocate()


def test_shared_blocks_are_counted_and_reset_forgets_every_name() -> None:
    p = pool(num_blocks=2)
    key = chain_hash(None, [5, 6, 7, 8])
    a = p.allocate()
    p.register(a, key)
    p.share(p.lookup(key))
    assert p.refs[a] == 2
    p.free([a])
    assert p.refs[a] == 1 and p.free_count == 1  # one holder left: not free
    p.free([a])
    assert p.free_count == 2 and p.lookup(key) == a
    p.share(a)  # taken back from the free list
    assert p.free_count == 1
    p.reset()
    assert p.lookup(key) is None and p.refs[a] == 1
    with pytest.raises(RuntimeError, match="freed more often"):
        p.free([a, a])
    assert pool(caching=False).lookup(key) is None


def test_chain_hashes_name_the_whole_prefix() -> None:
    first = chain_hash(None, [1, 2])
    assert chain_hash(first, [3, 4]) != chain_hash(chain_hash(None, [9, 9]), [3, 4])
    assert chain_hash(first, [3, 4]) == chain_hash(chain_hash(None, [1, 2]), [3, 4])


def test_a_long_prompt_is_chunked_and_decodes_go_first() -> None:
    paged = PagedSequences(pool(num_blocks=16), max_seq=32, vocab=100, token_budget=8)
    paged.admit(0, payload(list(range(10)), max_tokens=8))
    assert step(paged) == [(0, 8)]  # the first chunk samples nothing
    assert step(paged) == [(0, 2)]  # the rest of the prompt, and its first token
    paged.admit(1, payload(list(range(20, 32))))
    assert step(paged) == [(0, 1), (1, 7)]  # the decode first, then what the budget leaves
    assert step(paged) == [(0, 1), (1, 5)]
    assert step(paged) == [(0, 1), (1, 1)]
    seq0 = paged.by_id[0]
    assert seq0.cached == 13 and seq0.tokens == [7] * 4 and len(seq0.blocks) == 4


def test_sequences_wait_for_blocks_and_the_newest_is_preempted_and_resumes_unchanged() -> None:
    paged = PagedSequences(pool(num_blocks=4, caching=False), max_seq=16, vocab=100, token_budget=64)
    paged.admit(0, payload([1] * 6, max_tokens=6))
    paged.admit(1, payload([2] * 6, max_tokens=6))
    paged.admit(2, payload([3] * 6, max_tokens=6))
    assert step(paged) == [(0, 6), (1, 6)]  # 2 blocks each: the third waits
    assert [s.seq_id for s in paged.waiting] == [2] and paged.waits == 1
    assert step(paged) == [(0, 1), (1, 1)]  # column 6: still 2 blocks each
    assert step(paged) == [(0, 1), (1, 1)]  # column 7
    assert paged.preemptions == 0
    assert step(paged) == [(0, 1)]  # 0 needs a third block for column 8: 1 (the newest) is preempted
    assert paged.preemptions == 1 and [s.seq_id for s in paged.waiting] == [1, 2]
    resumed = paged.by_id[1]
    assert resumed.cached == 0 and resumed.pending == [2] * 6 + [7] * 3 and resumed.tokens == [7] * 3
    while paged:
        step(paged)
    assert paged.pool.free_count == 4 and not paged.running


def test_the_prefix_cache_is_reused_across_sequences_and_in_the_same_iteration() -> None:
    paged = PagedSequences(pool(num_blocks=32), max_seq=32, vocab=100, token_budget=64)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks of 4; at most 3 reused (the last token is computed)
    paged.admit(0, payload(prompt))
    paged.admit(1, payload(prompt))
    assert step(paged) == [(0, 13), (1, 1)]  # 1 shares the blocks 0 is writing in this same forward
    assert paged.pool.hits == 12 and paged.by_id[1].blocks[:3] == paged.by_id[0].blocks[:3]
    paged.admit(2, payload(prompt[:8] + [99] * 5))
    step(paged)
    assert paged.by_id[2].blocks[:2] == paged.by_id[0].blocks[:2] and paged.pool.hits == 20
    paged.pool.reset()  # a weight update
    paged.admit(3, payload(prompt))
    assert (3, 13) in step(paged) and paged.pool.hits == 20


def test_same_calls_make_the_same_decisions() -> None:
    def run() -> list:
        paged = PagedSequences(pool(num_blocks=6), max_seq=16, vocab=100, token_budget=5)
        log = []
        for i in range(6):
            paged.admit(i, payload([i + 1] * (3 + i), max_tokens=5))
            log.append(step(paged))
        while paged:
            log.append(step(paged))
        return log + [paged.preemptions]

    assert run() == run()


def test_a_cache_smaller_than_one_sequence_is_refused() -> None:
    with pytest.raises(ValueError, match=r"holds 2 blocks of 4 tokens, fewer than one sequence of max_model_len=16"):
        PagedSequences(pool(num_blocks=2), max_seq=16, vocab=100, token_budget=8)


def test_ragged_attention_equals_dense_causal_attention_per_sequence() -> None:
    torch.manual_seed(0)
    kv, group, d, size = 2, 2, 8, 4
    p = BlockPool(num_blocks=16, block_size=size, layers=1, kv_heads=kv, head_dim=d, to={"dtype": torch.float64})
    paged = PagedSequences(p, max_seq=32, vocab=100, token_budget=64)
    paged.admit(0, payload(list(range(9))))
    paged.admit(1, payload(list(range(3))))
    history = {0: [], 1: []}  # each sequence's (q, k, v) per column, to attend densely
    for _ in range(3):  # prefill both, then two decode iterations
        chunks = paged.schedule()
        batch = RaggedBatch.build(chunks, size, "cpu")
        n = batch.tokens.numel()
        q, k, v = (torch.randn(n, kv * group if i == 0 else kv, d, dtype=torch.float64) for i in range(3))
        batch.write(*p.layer(0), k, v)
        out = batch.attend(q, *p.layer(0))
        order = [c for c in chunks if c.n == 1] + [c for c in chunks if c.n > 1]
        start = 0
        for c in order:
            rows = slice(start, start + c.n)
            history[c.seq.seq_id] += list(zip(q[rows], k[rows], v[rows]))
            hq, hk, hv = (torch.stack([h[i] for h in history[c.seq.seq_id]]) for i in range(3))
            keys, values = hk.repeat_interleave(group, 1).transpose(0, 1), hv.repeat_interleave(group, 1).transpose(0, 1)
            want = torch.softmax(hq[-c.n:].transpose(0, 1) @ keys.transpose(1, 2) * d ** -0.5
                                 + torch.triu(torch.full((len(hk), len(hk)), float("-inf"), dtype=torch.float64),
                                              1)[-c.n:], -1) @ values
            torch.testing.assert_close(out[rows], want.transpose(0, 1))
            start += c.n
        sampled = sum(c.samples for c in chunks)
        paged.finish(chunks, [5] * sampled, [0.0] * sampled)


def test_decode_rows_sharing_prefix_blocks_read_them_once_and_equal_dense_attention() -> None:
    """Cascade: rows whose leading blocks are the same blocks attend to them as one group, and the merged
    softmax equals each row's dense attention over all its columns (float64)."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    kv, group, d, size = 2, 3, 8, 4
    p = BlockPool(num_blocks=16, block_size=size, layers=1, kv_heads=kv, head_dim=d, to={"dtype": torch.float64})
    keys, values = p.layer(0)
    keys.copy_(torch.randn_like(keys))
    values.copy_(torch.randn_like(values))
    rows = {"a": ([3, 5, 7], 10), "b": ([3, 5, 8], 11), "c": ([3, 5, 9, 12], 14),  # 2 blocks shared by a, b, c
            "d": ([3, 6], 6),  # block 3 only: the group a, b, c, d shares one block
            "e": ([10, 11], 5), "f": ([13, 14], 8), "g": ([13, 14], 8)}  # e alone; f, g share only block 13:
    # block 14 is where their new token goes (column 7), not yet written for both
    chunks = [Chunk(SimpleNamespace(pending=[1], cached=length - 1, blocks=blocks, seq_id=i), 1, True)
              for i, (blocks, length) in enumerate(rows.values())]
    batch = RaggedBatch.build(chunks, size, "cpu")
    assert sorted((s.rows.tolist(), s.blocks.tolist()) for s in batch.shared) == [([0, 1, 2, 3], [3]), ([5, 6], [13])]
    q = torch.randn(len(chunks), kv * group, d, dtype=torch.float64)
    out = batch.attend(q, keys, values)
    for i, (blocks, length) in enumerate(rows.values()):
        k = keys[blocks].reshape(-1, kv, d)[:length].repeat_interleave(group, 1).transpose(0, 1)
        v = values[blocks].reshape(-1, kv, d)[:length].repeat_interleave(group, 1).transpose(0, 1)
        want = torch.softmax(q[i][:, None] @ k.transpose(1, 2) * d ** -0.5, -1) @ v
        torch.testing.assert_close(out[i], want[:, 0])
    plain = RaggedBatch.build(chunks[4:5], size, "cpu")  # a row that shares nothing: no cascade
    assert plain.shared == ()


def test_prompts_that_outgrow_the_pool_together_both_finish_the_older_first() -> None:
    paged = PagedSequences(pool(num_blocks=6, caching=False), max_seq=24, vocab=100, token_budget=8)
    paged.admit(0, payload([1] * 18, max_tokens=4))  # up to 21 columns: 6 blocks, the whole pool
    paged.admit(1, payload([2] * 18, max_tokens=4))
    log = [step(paged) for _ in range(12)]
    assert log[:6] == [[(0, 8)], [(0, 8)], [(0, 2), (1, 4)],  # 1 starts in the last free block...
                       [(0, 1)], [(0, 1)], [(0, 1)]]  # ...waits there, and is preempted for 0's column 20
    assert paged.preemptions == 1 and log[6:] == [[(1, 8)], [(1, 8)], [(1, 2)], [(1, 1)], [(1, 1)], [(1, 1)]]
    assert not paged and paged.pool.free_count == 6


def test_a_recomputed_sequence_waits_and_does_not_name_blocks_of_the_old_weights() -> None:
    paged = PagedSequences(pool(num_blocks=16), max_seq=32, vocab=100, token_budget=64)
    paged.admit(0, payload(list(range(1, 10)), max_tokens=8))
    paged.admit(1, payload(list(range(1, 10)), max_tokens=8))
    step(paged)
    paged.pool.reset()  # a weight update: 1 is rebuilt, 0 keeps its cache (the engine's choice)
    paged.recompute(1)
    assert [s.seq_id for s in paged.waiting] == [1] and paged.by_id[1].pending == list(range(1, 10)) + [7]
    step(paged)
    step(paged)  # 0 fills its third block under the old weights: not named
    assert paged.pool.hits == 8  # the first admission's sharing only; 1's rebuild found nothing
    assert all(paged.pool.hash_of[b] is None for b in paged.by_id[0].blocks)
    assert any(paged.pool.hash_of[b] is not None for b in paged.by_id[1].blocks)
