"""The LLM runtime: what every token-generating plugin (`reference_lm`, `hf_causal_lm`) runs on.

    sequence.py   one generating sequence: sampling knobs, seeded generator, output, what it feeds next
    sampler.py    per-sequence sampling on the logits' device (no sort, one copy to the host)
    blocks.py     the KV cache: a pool of blocks, reference counts, automatic prefix caching
    paged.py      sequences over the block pool: waiting, preemption, chunked prefill (decodes first)
    ragged.py     one iteration's tokens unpadded, attention through the block tables
    paged_decoder.py  PagedDecoder: the one decoder loop, for the iteration protocol and whole requests
    sampling.py   Sampling, the request knobs every token plugin shares, and per-prompt seeds
    topology.py   what a decoder asks of a topology (decoder_rules) and one refusal (refuse)
    tokenizer.py  a checkpoint's tokenizer and chat template (tokenizers + jinja2), incremental text
    detok.py      incremental detokenization: a few tokens decoded per push (prefix / read offsets)

Plugins and the OpenAI edge import from here; nothing here imports a plugin (`phyai_ray.models`).
"""
