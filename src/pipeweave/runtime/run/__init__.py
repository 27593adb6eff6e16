"""A training run (layer 5 of ``pipeweave.runtime``): configured, planned, launched, recorded.

``pipeweave.config.TrainConfig`` describes a run (values only); ``prepare.prepare`` checks
it and resolves what every rank needs into a ``RunPlan`` (an asynchronous run's
streams and where it drains between them: ``streams``); ``launch.launch``
starts the ranks (spawned locally from a ``forkserver``, or under torchrun),
each running ``job.run_rank`` (synchronous schedules) or ``stream_job.run_stream_rank``
(asynchronous streams), evaluating and saving at ``milestones``
(``checkpoint``: saving and resuming with torch.distributed.checkpoint;
``checkpoint_state``: a rank's stages as one state dict, keyed by global
names; ``checkpoint_storage``: DCP's save and load; ``checkpoint_parts``:
the part files written before DCP; ``checkpoint_files``: the folders,
manifests and atomic commits in ``--save DIR``; ``save_lock``: one run per
folder); ``record`` gathers what they measured. It imports the executors and
the layers below them, never ``runtime.report``.
"""
