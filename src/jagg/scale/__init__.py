"""The real-model path at paper scale: FLUX.1-dev / Qwen-Image weights, their pipelines and rewards.

Hub loading, the real transformers, text encoders and VAE, LoRA, FSDP2 sharding, prompt sets and the HPSv2.1 /
PickScore / CLIPScore rewards, the published architectures and the weights check; docs/architecture.md lists the
modules.

Layer: beside ``jagg.world`` (neither imports the other); below the loop. It may import ``jagg.config`` and
the layers under it (``jagg.engine``, ``jagg.models``, ``jagg.rewards``, ``jagg.errors``, ``jagg.common``,
``jagg.distributed``).
"""
