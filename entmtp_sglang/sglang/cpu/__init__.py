"""What makes SGLang 0.5.23 run on CPU with ENTMTP, apart from the algorithm itself.

    ops.py        pure-torch versions of the `sgl_kernel` CPU ops SGLang's CPU path imports (and the
                  `sglang.srt.platforms` entry point that installs them where no CPU build provides them)
    rowwise.py    SGLang's float32 RMSNorm, SiLU-and-mul and rotary embedding through the package's row-wise ops
    linear.py     the batch-invariant linear-layer and output-layer hook (`model/linear.py`'s path)
    sampling.py   exact sampled verification on CPU: SGLang's tree rejection sampling in torch
    attention.py  the `entmtp_torch` attention backend (and the multi-step draft container)
    gather.py     its gather plans and batched SDPA, pure torch

Nothing is imported here: each module is imported where it is used (the platform entry point runs early, in every
SGLang process).
"""
