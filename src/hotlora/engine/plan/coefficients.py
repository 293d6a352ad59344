"""Activation coefficients of ``hotlora plan`` (activations.py says what they mean).

Written by ``PYTHONPATH=src python bench/plan_calibrate.py`` (x86_64, 2 threads, torch 2.13.0+cpu); the measured points
are in bench/results/plan_calibrate.json. Do not edit by hand: run the script again."""

COEFFICIENTS = {   'flux': {   'denoiser': {   'bfloat16': {'none': 17.1623, 'slots': 17.2292},
                                'float32': {'none': 15.0982, 'slots': 16.0982}}},
    'vae': {   'decode': {   'bfloat16': {'batch': 6.0891, 'one': 9.5},
                             'float32': {'batch': 6.0128, 'one': 7.7163}}}}
