"""The rollout step as a use case: groups, rewards, dynamic filter, over-sampling, partial rollout,
staleness (docs/rollout-step.md). Built on `Rollout.generate`: every sample takes Generate's path."""
