parser ThcIngressParser(packet_in pkt, out headers_t hdr, out metadata_t meta,
                        out ingress_intrinsic_metadata_t ig_intr_md) {
    state start {
        pkt.extract(ig_intr_md);
        pkt.advance(PORT_METADATA_SIZE);
        transition parse_eth;
    }
    state parse_eth {
        pkt.extract(hdr.eth);
        transition select(hdr.eth.ether_type) {
            ETH_IPV4: parse_ipv4;
            default: accept;
        }
    }
    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.protocol) {
            IP_UDP: parse_udp;
            default: accept;
        }
    }
    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            THC_PORT: parse_thc;
            default: accept;
        }
    }
    state parse_thc {
        pkt.extract(hdr.thc);
        transition select(hdr.thc.type) {
            T_DATA: parse_idx;
            T_NORM: parse_norm;
            default: accept;
        }
    }
    state parse_idx {
        pkt.extract(hdr.idx);
        transition accept;
    }
    state parse_norm {
        pkt.extract(hdr.norm);
        transition accept;
    }
}

control ThcIngressDeparser(packet_out pkt, inout headers_t hdr, in metadata_t meta,
                           in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    Checksum() ipv4_csum;
    apply {
        hdr.ipv4.hdr_checksum = ipv4_csum.update({
            hdr.ipv4.version,
            hdr.ipv4.ihl,
            hdr.ipv4.diffserv,
            hdr.ipv4.total_len,
            hdr.ipv4.identification,
            hdr.ipv4.flags,
            hdr.ipv4.frag_offset,
            hdr.ipv4.ttl,
            hdr.ipv4.protocol,
            hdr.ipv4.src,
            hdr.ipv4.dst
        });
        pkt.emit(hdr);
    }
}
