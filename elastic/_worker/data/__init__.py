"""The data position: the elastic sampler (exactly once per epoch at any world size) and the loader glue."""
