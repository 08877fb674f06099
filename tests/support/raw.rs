//! Raw request bytes sent as a `ProcessTurn` body, as a broken or hostile gateway might.

use std::net::SocketAddr;

use prost::Message as _;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use turnstile::grpc::pb;

/// Sends `body` as the request of `ProcessTurn` to the server at `addr`, with `token` as bearer
/// token when given; returns the status it fails with.
pub async fn send_raw(addr: SocketAddr, body: Vec<u8>, token: Option<&str>) -> tonic::Status {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let mut request = tonic::Request::new(body);
    if let Some(token) = token {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
    }
    grpc.unary(
        request,
        PathAndQuery::from_static("/turnstile.v1.TurnService/ProcessTurn"),
        RawCodec,
    )
    .await
    .expect_err("not a valid request")
}

/// Encodes the bytes as given; decodes a `ProcessTurnResponse`.
#[derive(Default)]
struct RawCodec;

struct RawEncoder;
struct ResponseDecoder;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = pb::ProcessTurnResponse;
    type Encoder = RawEncoder;
    type Decoder = ResponseDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> ResponseDecoder {
        ResponseDecoder
    }
}

impl Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        use bytes::BufMut as _;
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for ResponseDecoder {
    type Item = pb::ProcessTurnResponse;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, tonic::Status> {
        pb::ProcessTurnResponse::decode(src)
            .map(Some)
            .map_err(|e| tonic::Status::internal(e.to_string()))
    }
}
