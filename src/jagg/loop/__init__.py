"""The training loop and its composition root: the top layer, with the CLI ``jagg.train``.

    trainer     the loop: rollout -> update -> evaluate -> fit
    components  build_components: picks the model source (world / tiny / pretrained); checks the config
                against the full registries before anything is written
    rewards     imports every module that registers a reward; builds a run's rewards on its device
    checkpoint  checkpoint state: gathered from / loaded into the trainer's parts (FSDP-aware)
    grids       PNG sample grids and their geometry
    plan        the ``--dry-run`` plan (steps, groups, passes, memory) without weights

Layer: top; it may import every other layer. Nothing in ``jagg`` imports it except ``jagg.train``.
"""
