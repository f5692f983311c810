"""The memory plan: pure arithmetic over a model's shape, a memory policy and a GPU's memory.

Shared by the engine (its start-up budget, with measured terms) and the operator (the plan it
proves before a rollout, with predicted terms), so the two can never disagree on the formula.
Imports only the standard library (`.importlinter` keeps it so).
"""
