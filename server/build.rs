//! Compiles the checked-in gRPC protocol files (proto/) into Rust with protox, a protobuf
//! compiler written in Rust, so building needs no protoc binary.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/grpc_predict_v2.proto", "proto/gdsllm.proto"];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        .build_client(false)
        .compile_fds(descriptors)?;
    Ok(())
}
