"""Process groups (ParallelState), collectives with byte accounting, launch."""
