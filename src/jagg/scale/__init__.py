"""The real-model path at paper scale: FLUX.1-dev / Qwen-Image weights, their pipelines and rewards.

    hub          offline-aware loading of hub weights and data (fails fast with a clear message)
    pretrained   real transformers, schedulers, text encoders, VAE -> ``jagg.models.Components``
    pipelines    text encoders (with an embedding cache) and VAE decoder of the diffusers pipelines
    lora         peft LoRA on the transformer (Flow-GRPO targets), adapter save / load, peft + diffusers export
    distributed  torchrun / FSDP2: sharding (shards of rank 0's weights), dtypes, gathers, collective counting
    prompts      prompt datasets (HPDv2, DrawBench, Pick-a-Pic) and local prompt files
    rewards      HPSv2.1, PickScore, CLIPScore (registered in ``jagg.rewards`` when imported)

Layer: beside ``jagg.world`` (neither imports the other); below the loop. It may import ``jagg.config`` and
the layers under it (``jagg.engine``, ``jagg.models``, ``jagg.rewards``, ``jagg.errors``, ``jagg.common``).
"""
