"""Training drafters on a target's own hidden states: data, features, trainer."""
