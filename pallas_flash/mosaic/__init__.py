"""Mosaic GPU (Hopper, sm_90) kernels: TMA pipelines, warp specialisation and wgmma."""
