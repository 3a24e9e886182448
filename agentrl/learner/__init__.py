"""The learner: off-policy-corrected policy updates on batches from serve's buffer."""
