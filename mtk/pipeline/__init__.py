"""Pipeline parallelism for HF decoders: stage split, P2P, AFAB and 1F1B schedules."""
