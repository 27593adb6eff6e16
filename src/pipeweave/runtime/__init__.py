"""The torch runtime: executes any schedule of ``pipeweave.schedule`` on torch.distributed, and in one process.

The only package of pipeweave that imports ``torch.distributed``. It is built
in layers, each importing only from layers below it (a test keeps it so):

1. ``process`` -- what a process is as a rank: its device, how it was
   started, whom it dies with (no state).
2. ``transport/`` -- point-to-point messages between ranks and their order
   (gloo, NCCL or shared-memory rings), their metadata, aligned clocks; the
   run's device mesh (data x pipeline x tensor parallelism) and its groups;
   ``context`` -- one rank's ``RankContext`` (its mesh, transport, progress
   sink and wait timeout), built by the run and passed to what needs it: no
   module of the runtime holds run state.
3. ``stage/`` -- what one stage does with tensors: F, I, W, B and U of a
   slice of layers, recomputation, tied weights, tensor-parallel layers, the
   weight policy of an asynchronous schedule (pure tensor code in
   ``pipeweave.weights``), post-validated optimizer steps, learning-rate schedules.
4. executors -- ``executor`` (one rank interprets its lowered actions),
   ``replicas`` (a part's replicas' gradients summed by bucketed collectives),
   ``zero`` (ZeRO-1 and 2: the optimizer state, and the gradients, sharded), ``fsdp`` (ZeRO-3 by FSDP2's
   ``fully_shard``: the parameters too),
   ``clip`` (the global gradient norm over shards and replicas, clipped at U),
   ``loss_scale`` (fp16's dynamic loss scale: GradScaler's, one for the run, overflows agreed at U),
   ``walk`` and ``reference`` (every stage in one process: the tests' oracle),
   ``plain`` (single-process training, the exactness baseline), ``profile``
   (per-layer costs), ``stream`` (what an asynchronous stream is at run time),
   ``nonfinite`` (what every rank agrees on: a step's loss, the weights' finiteness).
5. ``run/`` -- a training run: its configuration, the plan resolved from it
   (its sizes checked before the schedule is built), the memory it needs per
   rank, checkpoints, records, what each rank does, the launcher.
6. ``report/`` -- summaries and traces of finished runs, measured beside simulated.
"""
