"""Stage 3 as a library: ``step3_rlhf/main.py`` assembles these parts into the loop.

    config.py       the flags (per-model pieces, RL pieces) and the checks made before anything loads
    algorithms.py   --algo NAME -> its spec; ``spec.load()`` -> its run-time class
    specs.py        what each algorithm is before anything loads: its flags (``*Args``) and its spec, no torch
    ppo.py, ...     the run-time classes (grpo.py, rloo.py, dpo.py, ...): one file, one ``step()`` each
    engines.py      the model/engine set: actor, reference, critic, reward (what the algorithm needs); the frozen
                    set of a saved policy (``dschat generate``, ``dschat eval --step 3``)
    rollout.py      generation -> Rollout (sequences, masks), log-probs and values of the answer tokens
    scoring.py      reward sources -> scores (reward model, rules, judge, user functions)
    evaluation.py   the held-out evaluation before and after training: sampled answers scored, the before/after
                    part of eval.json (``dschat eval --step 3`` evaluates a saved policy with it too)
    ema.py          the actor's exponential moving average
    onpolicy.py     the run-time defaults PPO, the GRPO family and online DPO share (prompts in, evaluation
                    by sampling)
"""
