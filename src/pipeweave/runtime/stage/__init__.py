"""What one stage does with tensors (layer 3 of ``pipeweave.runtime``).

``worker.StageWorker`` runs F, B, I, W and U of a consecutive slice of layers
(recomputation, activation accounting, deferred weight gradients);
``tied`` sums the gradients of weights shared between stages;
``tensor_parallel`` splits a layer's linear layers over a ``tp`` group (Megatron's
column/row-parallel layers, their collectives, the shards' splits);
``sequence_parallel`` shards the activations between them along the sequence
(Korthikanti et al.'s all-gather/reduce-scatter pairs); ``context_parallel``
splits every sequence over a ``cp`` group (ring attention); ``policy``
binds an asynchronous schedule's weight policy (which version each action
reads; the tensor code is ``pipeweave.weights``); ``post_validation``
replaces the optimizer step by an optimistic one with exact rollback;
``lr_schedule`` sets learning rates. It knows nothing of executors or runs and
imports only ``runtime.process`` and ``runtime.transport`` of the runtime.
"""
