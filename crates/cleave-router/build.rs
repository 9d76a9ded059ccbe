//! Compiles proto/kserve_v2.proto with protox (pure Rust), so no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/kserve_v2.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(false)
        // Raw tensor bytes stay `bytes::Bytes`: cut from the message without a copy.
        .bytes(".inference")
        .codec_path("crate::codec::grpc_timing::TimedCodec")
        .compile_fds(descriptors)?;
    Ok(())
}
