"""The one-box ExGRPO job (`exgrpo run`) and the GRPO-vs-ExGRPO experiment (`exgrpo experiment`).

A product built on the other packages' public APIs: the trainer (`exgrpo_trainer`), the SDK
(`exgrpo_client`), the rollout engines, graders and evaluation (`exgrpo_rollout`), and the pool
service's settings and embedded server (`exgrpo_pool.config`, `exgrpo_pool.embedded`). It also holds
what a CPU run starts from: synthetic arithmetic questions, a tiny model and its supervised warm
start, the SmolLM2 import, and the run report.

This file imports nothing, so `exgrpo_onebox.tiny` and the like load without the trainer.
"""
