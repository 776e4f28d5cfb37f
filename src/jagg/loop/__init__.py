"""The training loop and its composition root: the top layer, with the CLI ``jagg.train``.

    trainer     the loop: rollout -> update -> evaluate -> fit
    components  build_components: picks the model source (world / tiny / pretrained); checks the config
                against the full registries before anything is written
    preflight   the CLI's checks before the model code is imported: reward / prompt-set names, the device,
                fresh / resume / resume-if-checkpoint and a resumed config against run.json
    rewards     imports every module that registers a reward; builds a run's rewards on its device
    placement   where the trained backbone lives: LoRA, dtypes, device, FSDP2 shards received from rank 0
    checkpoint  checkpoint state, sharded (torch.distributed.checkpoint): each rank saves / loads its shards
    export      the trained weights once, on rank 0: a diffusers transformer folder or a peft LoRA adapter
    grids       PNG sample grids and their geometry
    trackers    log.report_to: the metrics rows and sample grids to TensorBoard / wandb (imported when named)
    plan        the ``--dry-run`` plan (steps, groups, passes, memory per rank and GPU size) without weights

Layer: top; it may import every other layer. Nothing in ``jagg`` imports it except ``jagg.train``.
"""
