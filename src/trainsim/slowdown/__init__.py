"""Overlap slowdown: the dataset of compute ops timed solo and overlapped with communication (stage 4),
the XGBoost model that predicts the slowdown (stage 5), and the predictor the timeline composer calls.

Modules: dataset (schema, validity checks), collect (measurement on this machine), a100_import (Echo's
published A100 data), features, train, predictor, stage. See docs/design-choices.md, "Overlap slowdown".
"""
