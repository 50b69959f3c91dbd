"""The recipe that makes the bundled default model pair (python/dflash2_rt/models/default).

Steps (each also runnable alone; all seeded and deterministic for a given Python stdlib):

    python -m dflash2_rt.train.corpus   --work W --out OUT   # stdlib corpus + byte-level BPE -> OUT/target/tokenizer.json
    python -m dflash2_rt.train.target   --work W --out OUT   # the glm_moe_dsa target (BF16)
    python -m dflash2_rt.train.mtp      --work W --out OUT   # its MTP layer (next-next-token head)
    python -m dflash2_rt.train.gen_data --work W --out OUT   # target-generated continuations (our Engine, "ar")
    python -m dflash2_rt.train.drafter  --work W --out OUT   # the DFlash 2 drafter -> OUT/draft
    python -m dflash2_rt.train.check    --work W --out OUT   # runtime == transformers / torch drafter, lossless
    python -m dflash2_rt.train.make_default_pair --out OUT   # all of the above

Training needs torch, transformers 5.x, tokenizers and safetensors (the runtime does not).
"""
