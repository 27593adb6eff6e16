"""Weight-version policies as pure tensor code, one implementation each.

Stash and vertical sync (``stash``), double buffer (``double_buffer``,
``wpipe``), PipeMare's rescheduling and discrepancy correction (``pipemare``),
SpecTrain's and XPipe's prediction (``prediction``, ``spectrain``, ``xpipe``)
along the next step each optimizer of ``--optimizer`` declares (``optimizers``),
AvgPipe's averaging (``avgpipe``); ``runtime.stage.policy`` binds them to the actions
of a schedule. Nothing here imports the runtime.
"""
