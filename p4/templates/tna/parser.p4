parser ThcIngressParser(packet_in pkt, out headers_t hdr, out metadata_t meta,
                        out ingress_intrinsic_metadata_t ig_intr_md) {
    // the recirculation ports (control plane): packets from them are in their second pass
    value_set<PortId_t>(4) recirc_ports;

    state start {
        pkt.extract(ig_intr_md);
        pkt.advance(PORT_METADATA_SIZE);
        transition select(ig_intr_md.ingress_port) {
#ifdef THC_TESTGEN_RECIRC_PORT
            // p4testgen implements no parser value sets (it drops the cases naming one), so
            // `thc p4 testgen` defines this constant port to reach pass 2 (p4/testgen.py)
            THC_TESTGEN_RECIRC_PORT: parse_bridge;
#else
            recirc_ports: parse_bridge;
#endif
            default: parse_eth;
        }
    }
    state parse_bridge {
        pkt.extract(hdr.bridge);
        transition parse_eth;
    }
$parse_states
}

control ThcIngressDeparser(packet_out pkt, inout headers_t hdr, in metadata_t meta,
                           in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    Checksum() ipv4_csum;
    apply {
        hdr.ipv4.hdr_checksum = ipv4_csum.update({
$ipv4_checksum_fields
        });
        pkt.emit(hdr);
    }
}
