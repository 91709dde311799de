"""`tether bench e2e`: a demo-sized run in each loop mode beside a one-process GRPO loop."""
