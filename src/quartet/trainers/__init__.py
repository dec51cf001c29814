"""Stages 1-3 (sft, label, rm) and the small loop pieces they share."""
