"""The optimizer inside the backward: update rules, the attached optimizer, its pass and its verifier."""
