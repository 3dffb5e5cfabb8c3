"""Hand-written test models (plain ``torch.nn``, no transformers), each named by a ``module:function`` spec.

Every function returns ``(model, example_inputs)`` and takes ``batch`` (and, where the model has a sequence,
``seq``) keyword arguments: ``tests.models.gpt:small``, ``tests.models.mlp:mlp_8b``, ``tests.models.vit:vit_l16``,
``tests.models.cnn:small``. ``planner.models.build_model`` calls them with meta as the default device.
"""
