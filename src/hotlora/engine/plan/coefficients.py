"""Activation coefficients of ``hotlora plan`` (activations.py says what they mean).

Written by ``PYTHONPATH=src python bench/plan_calibrate.py`` (x86_64, 2 threads, torch 2.13.0+cpu); the measured points
are in bench/results/plan_calibrate.json. Do not edit by hand: run the script again."""

COEFFICIENTS = {   'flux': {   'denoiser': {   'bfloat16': {'none': (17.0826, 81341), 'slots': (16.488, 756227)},
                                'float32': {'none': (15.0554, 87288), 'slots': (16.0554, 87300)}}},
    'ltx': {   'vae_decode': {   'bfloat16': (0.2755, 5996544, 12.9375),
                                 'float32': (0.2755, 5996544, 12.9375)}},
    'sana': {   'dc_ae_decode': {'bfloat16': (6.5391, 0, 0.0), 'float32': (4.5156, 0, 0.0)},
                'denoiser': {   'bfloat16': {   'none': (9.3495, 51377849),
                                                'slots': (9.3495, 51377849)},
                                'float32': {   'none': (9.3495, 102989123),
                                               'slots': (9.3495, 102989123)}}},
    'sdxl': {   'denoiser': {   'bfloat16': {   'none': (7.9315, 59778459),
                                                'slots': (7.9315, 59778459)},
                                'float32': {   'none': (6.885, 117974400),
                                               'slots': (6.885, 117974400)}}},
    'vae': {   'decode': {   'bfloat16': {'batch': (5.4051, 4833347), 'one': (9.3618, 760616)},
                             'float32': {'batch': (5.7043, 4474946), 'one': (7.5, 2359296)}}},
    'wan': {   'residual_vae_decode': {   'bfloat16': (17.3736, 51511296, 8.0839),
                                          'float32': (17.3736, 51511296, 8.0839)},
               'vae_decode': {   'bfloat16': (52.4652, 1898496, 2.8323),
                                 'float32': (52.4652, 1898496, 2.8323)}}}
