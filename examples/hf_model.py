"""Train a Hugging Face causal LM (``hf:TYPE``), built offline from its config, on 2 ranks with 1f1b.

    python examples/hf_model.py          # needs transformers (pip install 'pipeweave[hf]')

``hf:gpt2`` names the ``transformers`` model type; ``hf_config`` holds its
config's fields (nothing is downloaded). The model is cut before each decoder
block by ``pipeweave.pipeline`` and trained with its own loss on the built-in
byte corpus. The same run from the command line:
``pipeweave train --model hf:gpt2 --hf-config '{"n_layer": 2, ...}' --seq-len 32``.
"""

import json

import tempfile

import pipeweave

STEPS = 4
GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64, "vocab_size": 256}

if __name__ == "__main__":
    spec = pipeweave.models.ModelSpec(kind="custom", entry="hf:gpt2", hf_config=json.dumps(GPT2), seq_len=32)
    config = pipeweave.TrainConfig(schedule="1f1b", num_stages=2, num_microbatches=4, batch_size=8, steps=STEPS,
                                   optimizer="adamw", lr=3e-3, model=spec)
    print("layers:", spec.num_layers, "split before:", ", ".join(spec.custom.split_points))
    record = pipeweave.train(config, quiet=True, out=tempfile.mkdtemp())
    print(f"hf:gpt2 loss {record.losses[0]:.3f} -> {record.losses[-1]:.3f} after {STEPS} steps")
