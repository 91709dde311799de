"""`slime.utils` on tether: types, http_utils, misc, mask_utils, async_utils."""
