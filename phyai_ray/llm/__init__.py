"""The LLM runtime: what every token-generating plugin (`reference_lm`, `hf_causal_lm`) runs on.

    slots.py      running sequences, one KV-cache row each, packed
    sampler.py    per-sequence sampling on the logits' device (no sort, one copy to the host)
    decoder.py    SlotDecoder: the iteration protocol and whole-request generation over `Slots`
    blocks.py     a paged KV cache: the block pool, reference counts, automatic prefix caching
    paged.py      sequences over the block pool: waiting, preemption, chunked prefill (decodes first)
    ragged.py     one iteration's tokens unpadded, attention through the block tables
    paged_decoder.py  PagedDecoder: the iteration protocol over the paged cache (hf_causal_lm)
    sampling.py   Sampling, the request knobs every token plugin shares, and per-prompt seeds
    topology.py   what a slot decoder asks of a topology (decoder_rules) and one refusal (refuse)
    tokenizer.py  a checkpoint's tokenizer and chat template (tokenizers + jinja2), incremental text
    detok.py      incremental detokenization: a few tokens decoded per push (prefix / read offsets)

Plugins and the OpenAI edge import from here; nothing here imports a plugin (`phyai_ray.models`).
"""
