"""The planner (``pipeweave plan``): the whole parallel configuration of a GPT on a cluster, predicted by the
simulator. Pure Python, no torch.

``hardware`` and ``transformer`` describe the cluster and the model, ``flops``,
``efficiency``, ``costs`` and ``memory`` the cost model, ``pipeline`` and
``evaluate`` one configuration's prediction, ``space`` and ``search`` the
enumeration and its pruning, ``published`` Megatron-LM's Table 1 to check it on.
"""
