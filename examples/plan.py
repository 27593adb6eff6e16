"""The planner from Python: the best data x tensor x pipeline split, schedule, microbatch size,
recomputation and ZeRO stage for a GPT on a cluster, predicted by the simulator.

    python examples/plan.py

The same as ``pipeweave plan --model gpt-1.7b --gpus 64 --global-batch 256 --top 3``.
Any dimension can be held (``tensor_parallel=``, ``stages=``, ``schedule=``, ...).
"""

import pipeweave

if __name__ == "__main__":
    plan = pipeweave.plan("gpt-1.7b", gpus=64, global_batch=256, gpu="h100-sxm", top=3)
    print(f"{plan.candidates} configurations, {plan.simulations} simulated in {plan.seconds:.1f} s")
    for r in plan.best[:3]:  # best holds every simulated configuration that fits, fastest first
        c = r.config
        print(f"TP {c.tp} x PP {c.pp} x DP {c.dp}  {c.schedule:<16} b={c.microbatch_size} v={c.chunks} "
              f"recompute={c.recompute:<9} ZeRO-{c.zero}  step {r.step_time:.3f} s  MFU {r.mfu:.1%}  "
              f"{r.memory.total / 2**30:.1f} GiB")

    held = pipeweave.plan("gpt-1.7b", gpus=64, global_batch=256, gpu="h100-sxm", top=1,
                                  schedule="1f1b", stages=4)
    print(f"with 1f1b on 4 stages: step {held.best[0].step_time:.3f} s")
