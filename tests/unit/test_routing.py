"""The routing table (the vendor table's ``intra_gaps``): which reductions skip a group's vendor (issue 9).

Whatever a vendor cannot reduce goes through the bridge instead of failing;
the end-to-end check of those cases is the collective matrix on the
``KAITIAN_INTRA=gloo`` layouts (bool, int16, BAND/BOR/BXOR vs gloo).
"""

from __future__ import annotations

from kaitian.devices.vendors import intra_gaps
from kaitian.devices.vendors import VENDORS

DTYPES = {"float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool"}
OPS = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"}


def test_cuda_groups_route_what_nccl_and_gloo_lack():
    assert intra_gaps("cuda", "nccl") == {"int16", "bool", "BAND", "BOR", "BXOR"}


def test_cpu_groups_route_what_gloo_lacks():
    assert intra_gaps("cpu", "gloo") == {"int16", "bool"}


def test_cncl_groups_route_float64_through_the_bridge():
    # torch_mlu maps kDouble to cnclFloat: CNCL would round float64 silently (issue 16)
    assert intra_gaps("mlu", "cncl") == intra_gaps("cuda", "nccl") | {"float64"}


def test_a_gloo_intra_backend_routes_what_gloo_lacks():
    assert intra_gaps("cuda", "gloo") == {"int16", "bool"}


def test_unknown_vendor_is_assumed_to_lack_what_nccl_lacks():
    assert intra_gaps("npu", "hccl") == intra_gaps("cuda", "nccl")


def test_table_names_are_ones_the_backend_parses():
    # the C++ side rejects unknown names at init; keep the table within them
    for gaps in (v.intra_gaps for v in VENDORS.values()):
        assert gaps <= DTYPES | OPS, gaps - (DTYPES | OPS)
