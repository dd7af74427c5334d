"""A fa3-fwd build whose forward schema no mla-plugins release knows: `fa3_fwd::fwd` with a
required `int num_kv_splits` after `v` (tests/fakes/fa3/schemas.py UNKNOWN), as a future
release that inserts an argument without a default would register it. Calling it positionally
the old way would put `k_new` where the int goes, the failure AITER's #3391 caused; the
provider must refuse to bind it and say why, with the schema. No build-config module (a build
that ships none: flags unknown). The body is the same FA3 forward (kernel.py) and ignores the
new argument.
"""

from tests.fakes.fa3 import kernel, schemas

BUILD = kernel.Build("fa3_fwd", schemas.UNKNOWN)
kernel.register(BUILD)
