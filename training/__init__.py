"""Building what cannot be downloaded: the distilled student and the router's difficulty model.

Offline work, run by `tiergate models distill` and `tiergate router train` (and by `tiergate serve` on first
use, as child processes): distillation with its data and evaluation (`distill`, `distill_data`,
`distill_eval`, `student`, `model_card`, orchestrated per tier by `students`), and the router's training
(`router_prompts` → `tier_answers` → `fidelity` → `ridge`, orchestrated by `router_training`). It imports the
engine, the tiers, the cache's embedder and assets/; serving code never imports it.
"""
