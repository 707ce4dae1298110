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
