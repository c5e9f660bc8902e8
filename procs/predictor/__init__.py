"""Predictor process (BERT encoder + ranking head); see issue 4."""
