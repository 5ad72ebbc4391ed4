"""The step machinery: requests scheduled, batched, run on the model, sampled and
reported (engine_core.EngineCore drives one step at a time)."""
