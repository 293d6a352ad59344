"""The full-size models' published configurations, as Python dicts (one module per model):
what ``hotlora plan`` builds on the meta device and the full-size runs build with random weights.

Each module holds ``NAME`` (its plan name), ``HUB_ID``, ``MODEL_INDEX``, ``COMPONENTS`` (component ->
its config.json, with the key naming its class) and ``TOKENIZER_VOCABULARY`` (and, where the model
is published at several sizes, ``PLAN_SIZES``: the WIDTHxHEIGHT rows ``bench/plan_fit.py`` plans it
at); its docstring says
where every value comes from and what could not be confirmed. A family makes a module a plan name by
listing it in ``full_size_models`` (plan name -> module):

    family       full_size_models
    flux         {"flux-dev": "flux"}
    sdxl         {"sdxl": "sdxl"}
    zimage       {"zimage-turbo": "zimage_turbo"}
    qwenimage    {"qwen-image": "qwen_image"}  (+ {"qwen-image-2.1": "qwen_image_21"} in the family that
                 serves QwenImage21Pipeline / QwenImage21Transformer2DModel)
    flux2        {"flux2-dev": "flux2_dev"}
    flux2-klein  {"flux2-klein-4b": "flux2_klein_4b", "flux2-klein-9b": "flux2_klein_9b"}
    sd3          {"sd3.5-large": "sd35_large", "sd3.5-medium": "sd35_medium"}
    chroma       {"chroma1-hd": "chroma1_hd"}
    sd15         {"sd15": "sd15"}
    wan          {"wan2.1-t2v-1.3b": "wan21_t2v_1_3b", "wan2.1-t2v-14b": "wan21_t2v_14b",
                  "wan2.2-t2v-a14b": "wan22_t2v_a14b", "wan2.1-i2v-14b-480p": "wan21_i2v_14b_480p",
                  "wan2.2-i2v-a14b": "wan22_i2v_a14b", "wan2.2-ti2v-5b": "wan22_ti2v_5b",
                  "wan2.1-flf2v-14b-720p": "wan21_flf2v_14b_720p"}
    ltx          {"ltx-video": "ltx_video"}
    sana         {"sana-1600m": "sana_1600m"}  (the generic family's Claim)
    krea2        {"krea2-turbo": "krea2_turbo"}  (the generic family's Claim)

``_encoders`` holds the text encoders and VAEs several models share.
"""
